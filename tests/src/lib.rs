//! Cross-crate integration tests of ptl (in `tests/`), and the `ptl-ext` binary: ptl's command
//! line built by another crate with its own replay plugin ([`ptl_example_plugin`]) linked in,
//! exactly as a third party would, without touching `ptl-trainer` or `ptl-plugins`.
