//! The `ptl` binary: the command line of the `ptl` library with ptl's own replay plugins.

fn main() -> std::process::ExitCode {
    ptl::main()
}
