//! libFuzzer target: `ptl_data::fuzz::coco_json` must return normally for every input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ptl_data::fuzz::coco_json(data));
