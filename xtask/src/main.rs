//! `cargo xtask …`: project automation (gate, device packs, benchmarks).

use std::process::{Command, ExitCode};

mod artifacts;
mod bench;
mod device_pack;
mod fuzz;
mod gate;
mod goldens;
mod heads_pack;
mod outcome;
mod record;

fn usage() -> &'static str {
    "usage: cargo xtask <command>\n\
     commands:\n  \
       gate            cargo fmt --check, clippy -D warnings, cargo test --workspace\n  \
       device-pack     build the CUDA test/bench binaries + run.sh into device-pack/ (for the GPU machine)\n  \
       bench           training benchmark: arms in alternating fresh processes next to Ultralytics (--help)\n  \
       heads-pack      the model's CUDA golden tests + forward/backward bench next to PyTorch into heads-pack/\n  \
       outcome         long ptl and Ultralytics fits on one learnable set: final/best metrics, curves (--help)\n  \
       record          pack a measurement record's raw files into its raw.tar.xz (README, pictures, scripts stay)
  \
       goldens         pack a full copy of the reference tensors into goldens/data/ (--from DIR)\n  \
       fuzz            fuzz the label/yaml/COCO/image parsers (libFuzzer via cargo +nightly fuzz; --stable, --runs N)\n"
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("gate") => gate::run(),
        Some("device-pack") => device_pack::run(&args[1..]),
        Some("bench") => bench::run(&args[1..]),
        Some("heads-pack") => heads_pack::run(&args[1..]),
        Some("fuzz") => fuzz::run(&args[1..]),
        Some("outcome") => outcome::run(&args[1..]),
        Some("goldens") => goldens::run(&args[1..]),
        Some("record") => record::run(&args[1..]),
        Some("-h") | Some("--help") | None => {
            print!("{}", usage());
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command `{other}`\n{}", usage())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `cargo <args>` in the workspace root, failing with a message that names the step.
pub(crate) fn cargo(step: &str, args: &[&str]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("xtask: {step}: cargo {}", args.join(" "));
    let status =
        Command::new(cargo).args(args).current_dir(workspace_root()).status().map_err(|e| format!("{step}: could not start cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{step} failed ({status})"))
    }
}

/// The workspace root (the parent of this crate's folder).
pub(crate) fn workspace_root() -> std::path::PathBuf {
    let here = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(|p| p.to_path_buf()).unwrap_or(here)
}
