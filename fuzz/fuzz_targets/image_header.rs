//! libFuzzer target: `ptl_data::fuzz::image_header` must return normally for every input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ptl_data::fuzz::image_header(data));
