//! The local gate: exactly what CI runs (`.ci/run`).

pub(crate) fn run() -> Result<(), String> {
    crate::cargo("format", &["fmt", "--all", "--", "--check"])?;
    crate::cargo("lint", &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    crate::cargo("tests", &["test", "--workspace"])?;
    eprintln!("xtask: gate passed");
    Ok(())
}
