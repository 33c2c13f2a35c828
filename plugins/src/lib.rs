//! # ptl-plugins
//!
//! Replay strategies for ptl fits, registered through `inventory` so that a fit's `replay=` list
//! finds them (the trainer never imports this crate; linking it is enough):
//!
//! - `replay=feature` ([`Scope::Trunk`]): the trunk (backbone + neck) forward and backward as one
//!   recorded region. Its features receive gradient from the one-to-many stems; the one-to-one
//!   stems read detached copies (the head detaches them outside the region).
//! - `replay=stem` ([`Scope::Stems`]): each of the head's 18 stems as its own region and autograd node (a
//!   point stem's region includes its keypoint and uncertainty views).
//! - `replay=ns` ([`NsReplay`]): MuSGD's batched Newton–Schulz, one region per group of equal
//!   matrix shapes: the update's nested `Site::NewtonSchulz`.
//! - `replay=optimizer` ([`UpdateReplay`]): the device part of the optimizer step (clipping and
//!   the SGD / MuSGD update) as one region per gradient-presence mask.
//!
//! - `replay=loss` ([`LossReplay`]): the dense criterion (`loss_assigner=dense`) as one region
//!   and autograd node per batch shape and target bucket.
//! - `replay=step` ([`LossReplay::STEP`]): a step's whole forward and that criterion as one
//!   region per batch shape and target bucket (one forward and one backward graph per step);
//!   the trunk, stem and loss regions then see only the steps it cannot take.
//!
//! Both record with CUDA graphs on a GPU and with `ptl-capture`'s test double on the CPU (which
//! re-runs the body on replay), so CPU CI exercises the recorder's real state machine. Every
//! region falls back to native execution when it must (warm-up, another shape, a capture
//! failure, …) and says so in its counters: check them ([`replay_shortfalls`]) before believing
//! "replay equals native".
//!
//! ## Replay from Rust code
//! A fit names the plugins in its `replay` setting (`ptl train`'s `replay=` key); on the CPU
//! they record with the test double, on a GPU with CUDA graphs:
//!
//! ```
//! use ptl_trainer::pose::{fit, PoseTrainConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::env::temp_dir().join(format!("ptl-plugins-doc-{}", std::process::id()));
//! let set = ptl_data::synth_generate(&ptl_data::SynthOptions {
//!     out: dir.join("data"), train: 6, background: 0, val: 2, imgsz: 64, ..Default::default()
//! })?;
//! let mut cfg = PoseTrainConfig { data: set.yaml, epochs: 2, batch: 2, imgsz: 64, save_dir: dir.join("run"), ..Default::default() };
//! cfg.set("optimizer", "SGD")?;
//! cfg.set("plots", "false")?;
//! cfg.set("replay", "feature")?; // the trunk's forward and backward as one recorded region
//! let summary = fit(&cfg, vec![])?;
//! // 2 epochs × 3 batches: every call after the region's warm-up replayed.
//! assert!(ptl_plugins::replay_shortfalls(&summary, ptl_plugins::PieceReplay::FEATURE, 6, &[]).is_empty());
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
#[doc = include_str!("../../docs/plugins.md")]
pub mod guide {}

mod guard;
mod keyed;
mod loss;
mod ns;
mod regions;
mod replay;
mod update;

pub use guard::replay_shortfalls;
pub use loss::LossReplay;
pub use ns::NsReplay;
pub use regions::PieceRegions;
pub use replay::{plugin_defaults, PieceReplay, Scope};
pub use update::UpdateReplay;
