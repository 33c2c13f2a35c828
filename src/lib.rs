//! The `ptl` command line as a library: [`main`] is the whole program, so another crate builds its
//! own `ptl` binary with its replay plugins linked in:
//!
//! ```text
//! use my_plugin as _;                  // registers through inventory
//! fn main() -> std::process::ExitCode { ptl::main() }
//! ```
//!
//! Each subcommand group parses its own arguments and calls into the library crates; add new
//! groups (`train`, `val`, `predict`, `export`) as variants of `Command` with a `run_*` function.

#![warn(missing_docs)]
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

mod cli;

// The replay plugins that ship with ptl (`replay=feature,stem`), registered through inventory.
use ptl_plugins as _;

#[derive(Parser, Debug)]
#[command(name = "ptl", version, about = "Train YOLO26n-pose models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Warnings and errors only (no per-epoch lines or notes).
    #[arg(short, long, global = true)]
    quiet: bool,
    /// More messages: -v debug, -vv trace.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Dataset tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// Train a pose model (no arguments: the embedded synthetic default).
    Train(cli::train::TrainArgs),
    /// Validate a checkpoint (EMA weights) on a dataset's val split.
    Val(cli::predict::ValArgs),
    /// Draw predictions of a checkpoint on images (PNGs + predictions.json).
    Predict(cli::predict::PredictArgs),
    /// Write the eval model as an ONNX file (`ptl export format=onnx model=W.ckpt imgsz=640`).
    Export(cli::export::ExportArgs),
    /// List every `key=value` setting of `ptl train` with its default.
    Cfg,
}

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// Write the synthetic pose dataset (Ultralytics layout: images/, labels/, data.yaml).
    Synth(SynthArgs),
}

#[derive(Args, Debug)]
struct SynthArgs {
    /// Output folder (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Training images in total, background images included.
    #[arg(long, default_value_t = 512)]
    train: usize,
    /// Person-free training images.
    #[arg(long, default_value_t = 226)]
    background: usize,
    /// Validation images.
    #[arg(long, default_value_t = 15)]
    val: usize,
    /// Long side of the largest generated image.
    #[arg(long, default_value_t = 640)]
    imgsz: u32,
    /// Random seed (same seed ⇒ same bytes).
    #[arg(long, default_value_t = 347)]
    seed: u64,
    /// JPEG quality.
    #[arg(long, default_value_t = 90)]
    quality: u8,
    /// Threads (0 = all cores; the output does not depend on it).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Classes of the labels (1: person). More give the people of each image classes in turn,
    /// named person, person1, …: labels only (they look alike), to try multi-class training.
    #[arg(long, default_value_t = 1)]
    classes: usize,
}

fn run_data(cmd: DataCommand) -> Result<(), ptl_data::DataError> {
    match cmd {
        DataCommand::Synth(a) => {
            let t0 = std::time::Instant::now();
            let st = ptl_data::synth_generate(&ptl_data::SynthOptions {
                out: a.out,
                train: a.train,
                background: a.background,
                val: a.val,
                imgsz: a.imgsz,
                seed: a.seed,
                jpeg_quality: a.quality,
                threads: a.threads,
                classes: a.classes,
            })?;
            println!(
                "train {} images ({} background, {} persons), val {} images ({} persons), keypoint visibility 0/1/2: {}/{}/{} in {:.1}s -> {}",
                st.train_images,
                st.train_background,
                st.train_instances,
                st.val_images,
                st.val_instances,
                st.visibility[0],
                st.visibility[1],
                st.visibility[2],
                t0.elapsed().as_secs_f64(),
                st.yaml.display()
            );
            Ok(())
        }
    }
}

/// Runs the `ptl` command line on the process arguments.
pub fn main() -> ExitCode {
    ptl_trainer::pose::mark_program_start();
    keep_nvlink_multicast_off();
    let cli = Cli::parse();
    cli::logger::install(cli::logger::level(cli.quiet, cli.verbose));
    let res: Result<(), cli::Failure> = match cli.command {
        Command::Data(c) => run_data(c).map_err(|e| e.to_string().into()),
        Command::Train(a) => cli::train::run_train(a),
        Command::Val(a) => cli::predict::run_val(a).map_err(Into::into),
        Command::Predict(a) => cli::predict::run_predict(a).map_err(Into::into),
        Command::Export(a) => cli::export::run_export(a).map_err(Into::into),
        Command::Cfg => {
            cli::train::print_keys();
            Ok(())
        }
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}

/// In a process a launcher started (`RANK` set: torchrun, SLURM; ptl's own launcher sets it for
/// its workers), NCCL's NVLink multicast stays off unless the user set `NCCL_NVLS_ENABLE`. Set
/// first thing in `main`, while the process has one thread, so NCCL reads it at its init.
fn keep_nvlink_multicast_off() {
    if std::env::var_os("RANK").is_some() && std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
}
