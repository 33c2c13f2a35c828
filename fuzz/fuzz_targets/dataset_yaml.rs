//! libFuzzer target: `ptl_data::fuzz::dataset_yaml` must return normally for every input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ptl_data::fuzz::dataset_yaml(data));
