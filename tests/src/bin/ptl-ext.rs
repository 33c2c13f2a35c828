//! `ptl` with a third-party replay plugin: linking the plugin's crate registers it.

use ptl_example_plugin as _;

fn main() -> std::process::ExitCode {
    ptl::main()
}
