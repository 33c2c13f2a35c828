//! A run's checkpoint, its restore, and the hashes that prove two runs equal.

use std::path::Path;

use ptl_autograd::{hash, DType, Tensor};

use crate::fit::{Checkpoint, Manifest, RunHashes};
use crate::{Result, TrainerError};

use super::run::*;

use crate::fit::checkpoint::WEIGHTS_ONLY;

impl Run {
    pub(super) fn checkpoint(&self, train_args: &serde_json::Value) -> Result<Checkpoint> {
        let mut tensors: Vec<(String, Tensor)> = float_state(&self.model).into_iter().map(|(n, t)| (format!("model.{n}"), t)).collect();
        tensors.extend(self.ema.ema_tensors().iter().map(|(n, t)| (format!("ema.{n}"), t.clone())));
        tensors.extend(self.optimizer.state_tensors().into_iter().map(|(n, t)| (format!("optim.{n}"), t)));
        // Gradients accumulated since the last optimizer step carry over epochs (docs/training.md §2):
        // keep them so a resumed run continues with exactly the same sums.
        for (n, p) in model_params(&self.model) {
            if let Some(g) = p.grad() {
                tensors.push((format!("grad.{n}"), g));
            }
        }
        let scaler = match &self.scaler {
            Some(s) => serde_json::to_value(s.state()?).unwrap_or(serde_json::Value::Null),
            None => serde_json::Value::Null,
        };
        let optimizer = serde_json::json!({
            "meta": serde_json::to_value(self.optimizer.state_meta()).unwrap_or(serde_json::Value::Null),
            "scheduler": serde_json::to_value(&self.scheduler).unwrap_or(serde_json::Value::Null),
            "accumulate": self.accumulate,
            "resolved": self.resolved,
        });
        Ok(Checkpoint {
            manifest: Manifest {
                format: crate::fit::checkpoint::CHECKPOINT_FORMAT,
                ptl_version: env!("CARGO_PKG_VERSION").into(),
                loop_state: self.state.clone(),
                train_args: train_args.clone(),
                optimizer,
                scaler,
                ema: serde_json::to_value(self.ema.meta()).unwrap_or(serde_json::Value::Null),
                criterion: serde_json::json!({ "updates": self.criterion.updates }),
                callbacks: self.callbacks.iter().map(|c| (c.state_key(), c.state())).collect(),
                plugins: self.plugins.states(),
                recordings: "none".into(),
                history: self.history.clone(),
                names: self.names.clone(),
            },
            tensors,
        })
    }

    /// The weights Ultralytics ships as `best.pt` and `last.pt`, taken from the run's full
    /// checkpoint `full`: the EMA model in half precision, with the run's settings, counters and
    /// history, and nothing else (no live model, optimizer state, scaler or pending gradients) —
    /// what validation, prediction, export and fine-tuning read, at a tenth of a full
    /// checkpoint's size. Not resumable (`refuse_resume_from_weights`).
    pub(super) fn weights_only(full: &Checkpoint) -> Result<Checkpoint> {
        let tensors = full
            .tensors
            .iter()
            .filter(|(n, _)| n.starts_with("ema."))
            .map(|(n, t)| Ok((n.clone(), if t.dtype().is_float() { t.to_dtype(DType::F16)? } else { t.clone() })))
            .collect::<Result<Vec<_>>>()?;
        let mut manifest = full.manifest.clone();
        manifest.optimizer = serde_json::json!({ WEIGHTS_ONLY: true, "resolved": full.manifest.optimizer["resolved"] });
        (manifest.scaler, manifest.criterion) = (serde_json::Value::Null, serde_json::Value::Null);
        manifest.callbacks.clear();
        manifest.plugins.clear();
        Ok(Checkpoint { manifest, tensors })
    }

    /// Restores the run from a checkpoint. `ema_into_model`: the live model takes the EMA weights
    /// (docs/training.md §9's recovery from a non-finite loss) instead of its own.
    pub(super) fn restore(&mut self, path: &Path, ema_into_model: bool) -> Result<()> {
        let ck = crate::fit::load_checkpoint(path, self.cfg.device)?;
        let bad = |msg: String| TrainerError::Checkpoint { path: path.to_path_buf(), msg };
        crate::fit::checkpoint::refuse_resume_from_weights(path, &ck.manifest)?;
        let stored = &ck.manifest.optimizer["resolved"];
        if !stored.is_null() && *stored != self.resolved {
            return Err(bad(format!("the optimizer resolves to {} now but the run used {stored}", self.resolved)));
        }
        let model_part = if ema_into_model { "ema" } else { "model" };
        self.model.load_state_dict(&ck.part(model_part), !ema_into_model).map_err(|e| bad(e.to_string()))?;
        let ema_meta = serde_json::from_value(ck.manifest.ema.clone()).map_err(|e| bad(format!("EMA state: {e}")))?;
        self.ema.load(&ema_meta, &ck.part("ema"))?;
        self.optimizer.load_state_tensors(&ck.part("optim"))?;
        let meta = serde_json::from_value(ck.manifest.optimizer["meta"].clone()).map_err(|e| bad(format!("optimizer state: {e}")))?;
        self.optimizer.load_state_meta(&meta)?;
        self.scheduler =
            serde_json::from_value(ck.manifest.optimizer["scheduler"].clone()).map_err(|e| bad(format!("scheduler state: {e}")))?;
        if let Some(acc) = ck.manifest.optimizer["accumulate"].as_u64() {
            self.accumulate = acc as usize;
        }
        if let Some(s) = self.scaler.as_mut() {
            let st: Option<crate::optim::scaler::ScalerState> =
                serde_json::from_value(ck.manifest.scaler.clone()).map_err(|e| bad(format!("scaler state: {e}")))?;
            s.load_state(st.as_ref())?;
        }
        if let Some(u) = ck.manifest.criterion["updates"].as_u64() {
            self.criterion.set_updates(u as usize);
        }
        let grads = ck.part("grad");
        for (n, p) in model_params(&self.model) {
            p.set_grad(match grads.get(&n) {
                Some(g) => Some(g.deep_copy()?),
                None => None,
            });
        }
        self.state = ck.manifest.loop_state.clone();
        self.history = ck.manifest.history.clone();
        self.plugins.load_states(&ck.manifest.plugins)?;
        Ok(())
    }

    pub(super) fn hashes(&self) -> Result<RunHashes> {
        let model = float_state(&self.model);
        let opt = self.optimizer.state_tensors();
        let ema = self.ema.ema_tensors();
        let losses: Vec<u8> = self.state.step_losses.iter().flat_map(|l| l.to_le_bytes()).collect();
        Ok(RunHashes {
            model: hash::named_tensors_hash(model.iter().map(|(n, t)| (n.as_str(), t)))?,
            optimizer: {
                let meta = serde_json::to_string(&self.optimizer.state_meta()).unwrap_or_default();
                let t = hash::named_tensors_hash(opt.iter().map(|(n, t)| (n.as_str(), t)))?;
                hash::bytes_hash(format!("{t}{meta}").as_bytes())
            },
            scheduler: hash::bytes_hash(serde_json::to_string(&self.scheduler).unwrap_or_default().as_bytes()),
            ema: hash::named_tensors_hash(ema.iter().map(|(n, t)| (n.as_str(), t)))?,
            step_losses: hash::bytes_hash(&losses),
        })
    }
}
