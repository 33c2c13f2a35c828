//! Parameter classification, parameter groups and the `optimizer=auto` rule (docs/training.md §2–§3).

use std::collections::HashSet;

use ptl_autograd::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainerError};

/// Which optimizer family to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimizerName {
    /// MuSGD for long runs, AdamW for short ones (§3.1).
    Auto,
    /// SGD with Nesterov momentum.
    #[serde(rename = "SGD")]
    Sgd,
    /// MuSGD: SGD plus an orthogonalised (Muon) update.
    #[serde(rename = "MuSGD")]
    MuSgd,
    /// AdamW.
    AdamW,
}

impl OptimizerName {
    /// Parses the Ultralytics spelling (`auto`, `SGD`, `MuSGD`, `AdamW`; case-insensitive).
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(OptimizerName::Auto),
            "sgd" => Ok(OptimizerName::Sgd),
            "musgd" => Ok(OptimizerName::MuSgd),
            "adamw" => Ok(OptimizerName::AdamW),
            // Ultralytics' other optimizers, refused by name rather than trained as another one.
            "adam" | "adamax" | "nadam" | "radam" | "rmsprop" => Err(TrainerError::InvalidArgument {
                what: "optimizer",
                reason: format!("`{}` is one of Ultralytics' optimizers ptl does not implement: use auto, SGD, MuSGD or AdamW", s.trim()),
            }),
            other => Err(TrainerError::InvalidArgument {
                what: "optimizer",
                reason: format!("unknown optimizer `{other}`: use auto, SGD, MuSGD or AdamW"),
            }),
        }
    }

    /// The name as Ultralytics writes it into the run arguments.
    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerName::Auto => "auto",
            OptimizerName::Sgd => "SGD",
            OptimizerName::MuSgd => "MuSGD",
            OptimizerName::AdamW => "AdamW",
        }
    }
}

/// Precision of the Newton–Schulz orthogonalisation inside MuSGD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum NsPrecision {
    /// The reference: every op rounded to bfloat16 (docs/training.md §3.5).
    #[default]
    Bf16,
    /// Every op in f32.
    F32,
    /// Precise target for tests (`ns_out_f64` goldens).
    F64,
}

/// Everything `build_optimizer` needs. Defaults are the Ultralytics defaults (docs/training.md §1).
#[derive(Clone, Debug)]
pub struct OptimizerConfig {
    /// The optimizer.
    pub name: OptimizerName,
    /// Used only for an explicitly named optimizer (`auto` chooses its own).
    pub lr0: f64,
    /// Run-argument momentum (0.937): constructor momentum for explicit SGD/MuSGD, β₁ for explicit
    /// AdamW. `auto` constructs with 0.9 instead.
    pub momentum: f64,
    /// Unscaled weight decay from the arguments (0.0005).
    pub weight_decay: f64,
    /// Nominal batch size (64).
    pub nbs: usize,
    /// Total batch size over all devices (16).
    pub batch: usize,
    /// Nominal 64-image steps of the whole run, see [`auto_iterations`] (only read by `auto`).
    pub iterations: usize,
    /// Number of classes of the dataset (`None` → 10, as Ultralytics does when absent).
    pub nc: Option<usize>,
    /// `warmup_bias_lr` of the arguments (0.1); `auto` sets it to 0.
    pub warmup_bias_lr: f64,
    /// Module prefixes that are normalisation layers (their weights go to the `bn` group). `None`
    /// uses the name rule: the owning module's last path component is `bn`.
    pub norm_modules: Option<HashSet<String>>,
    /// Newton–Schulz's arithmetic.
    pub ns_precision: NsPrecision,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            name: OptimizerName::Auto,
            lr0: 0.01,
            momentum: 0.937,
            weight_decay: 0.0005,
            nbs: 64,
            batch: 16,
            iterations: 0,
            nc: None,
            warmup_bias_lr: 0.1,
            norm_modules: None,
            ns_precision: NsPrecision::Bf16,
        }
    }
}

/// Python `round()` / NumPy `round` (half to even).
pub fn round_half_even(x: f64) -> f64 {
    x.round_ties_even()
}

/// `max(round(nbs / batch), 1)` (§2), before the cap by the number of batches.
pub fn nominal_accumulate(nbs: usize, batch: usize) -> Result<usize> {
    if batch == 0 {
        return Err(TrainerError::InvalidArgument { what: "batch", reason: "must be at least 1".into() });
    }
    Ok((round_half_even(nbs as f64 / batch as f64) as usize).max(1))
}

/// The nominal accumulate capped at `nb · epochs` (no cap in `time` mode: pass `None`).
pub fn capped_accumulate(nbs: usize, batch: usize, batches_times_epochs: Option<usize>) -> Result<usize> {
    let acc = nominal_accumulate(nbs, batch)?;
    Ok(match batches_times_epochs {
        Some(cap) => acc.min(cap.max(1)),
        None => acc,
    })
}

/// Whether an optimizer step is due after batch `ni` (§2): `ni − last_opt_step ≥ accumulate`,
/// with `last_opt_step = −1` before the first step.
pub fn step_due(ni: usize, last_opt_step: i64, accumulate: usize) -> bool {
    ni as i64 - last_opt_step >= accumulate as i64
}

/// `weight_decay · batch · accumulate / nbs` with the uncapped accumulate (§2).
pub fn scaled_weight_decay(weight_decay: f64, batch: usize, nbs: usize) -> Result<f64> {
    if nbs == 0 {
        return Err(TrainerError::InvalidArgument { what: "nbs", reason: "must be at least 1".into() });
    }
    let acc = nominal_accumulate(nbs, batch)?;
    Ok(weight_decay * batch as f64 * acc as f64 / nbs as f64)
}

/// `ceil(dataset_size / max(batch, nbs)) · epochs` (§3.1).
pub fn auto_iterations(dataset_size: usize, batch: usize, nbs: usize, epochs: usize) -> usize {
    let d = batch.max(nbs).max(1);
    dataset_size.div_ceil(d) * epochs
}

/// What `auto` (or an explicit name) resolves to; the fit loop writes `name`, `lr0` and
/// `warmup_bias_lr` back into the run arguments (momentum is *not* written back).
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedOptimizer {
    /// The optimizer chosen.
    pub name: OptimizerName,
    /// Its initial learning rate.
    pub lr0: f64,
    /// Constructor momentum (β₁ for AdamW).
    pub momentum: f64,
    /// The bias groups' warm-up start.
    pub warmup_bias_lr: f64,
    /// Scaled weight decay (§2).
    pub weight_decay: f64,
}

fn round6(x: f64) -> f64 {
    // Python round(x, 6): correctly rounded decimal, via Rust's exact formatting.
    format!("{x:.6}").parse().unwrap_or(x)
}

/// Applies the `auto` rule (§3.1) and the weight-decay scaling.
pub fn resolve(cfg: &OptimizerConfig) -> Result<ResolvedOptimizer> {
    let weight_decay = scaled_weight_decay(cfg.weight_decay, cfg.batch, cfg.nbs)?;
    Ok(match cfg.name {
        OptimizerName::Auto => {
            let nc = cfg.nc.unwrap_or(10);
            if cfg.iterations > 10_000 {
                ResolvedOptimizer { name: OptimizerName::MuSgd, lr0: 0.01, momentum: 0.9, warmup_bias_lr: 0.0, weight_decay }
            } else {
                let lr0 = round6(0.002 * 5.0 / (4.0 + nc as f64));
                ResolvedOptimizer { name: OptimizerName::AdamW, lr0, momentum: 0.9, warmup_bias_lr: 0.0, weight_decay }
            }
        }
        name => ResolvedOptimizer { name, lr0: cfg.lr0, momentum: cfg.momentum, warmup_bias_lr: cfg.warmup_bias_lr, weight_decay },
    })
}

/// The four parameter classes of §3.2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParamKind {
    /// Weights with decay.
    Weight,
    /// Batch-norm weights, no decay.
    Bn,
    /// Biases, no decay.
    Bias,
    /// 2-D/4-D weights with the Muon update.
    Muon,
}

impl ParamKind {
    /// Ultralytics' `param_group` name.
    pub fn as_str(self) -> &'static str {
        match self {
            ParamKind::Weight => "weight",
            ParamKind::Bn => "bn",
            ParamKind::Bias => "bias",
            ParamKind::Muon => "muon",
        }
    }
}

/// Module prefixes of normalisation layers, found from a state dict: every module that owns a
/// `running_mean` buffer.
pub fn norm_modules_from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> HashSet<String> {
    names.into_iter().filter_map(|n| n.strip_suffix(".running_mean")).map(str::to_string).collect()
}

fn owner(name: &str) -> &str {
    name.rsplit_once('.').map(|(m, _)| m).unwrap_or("")
}

/// Whether `name` belongs to a normalisation layer.
pub fn is_norm_param(name: &str, norm_modules: Option<&HashSet<String>>) -> bool {
    let m = owner(name);
    match norm_modules {
        Some(set) => set.contains(m),
        None => m.rsplit('.').next() == Some("bn"),
    }
}

/// Classifies one parameter (§3.2): muon (2-D/4-D, MuSGD only), then bias (name contains
/// "bias"), then bn (normalisation layer), else weight.
pub fn classify(name: &str, dims: &[usize], use_muon: bool, norm_modules: Option<&HashSet<String>>) -> ParamKind {
    if use_muon && matches!(dims.len(), 2 | 4) {
        ParamKind::Muon
    } else if name.contains("bias") {
        ParamKind::Bias
    } else if is_norm_param(name, norm_modules) {
        ParamKind::Bn
    } else {
        ParamKind::Weight
    }
}

/// Class-stem parameters (`model.<i>.cv3.*`, `model.<i>.one2one_cv3.*` — direct children of a
/// top-level layer, i.e. the head) get 3× the learning rate under MuSGD.
pub fn is_boosted(name: &str) -> bool {
    let mut it = name.split('.');
    let (first, _idx, stem) = (it.next(), it.next(), it.next());
    first == Some("model") && matches!(stem, Some("cv3") | Some("one2one_cv3"))
}

/// One parameter of a group.
#[derive(Clone, Debug)]
pub struct NamedParam {
    /// State-dict name.
    pub name: String,
    /// The parameter.
    pub tensor: Tensor,
}

/// One optimizer parameter group with its mutable hyper-parameters.
#[derive(Clone, Debug)]
pub struct ParamGroup {
    /// Which kind of parameters.
    pub kind: ParamKind,
    /// The class stems' group at 3·lr0.
    pub boosted: bool,
    /// Current learning rate (written by warm-up and the scheduler).
    pub lr: f64,
    /// The group's lr at construction (`initial_lr` of the scheduler).
    pub initial_lr: f64,
    /// SGD/MuSGD momentum; `None` for AdamW (its β₁ lives in `betas`).
    pub momentum: Option<f64>,
    /// Adam's (β₁, β₂).
    pub betas: Option<(f64, f64)>,
    /// Adam's ε.
    pub eps: f64,
    /// Weight decay (scaled).
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Muon update.
    pub use_muon: bool,
    /// The parameters.
    pub params: Vec<NamedParam>,
}

impl ParamGroup {
    /// Ultralytics' `param_group` name.
    pub fn name(&self) -> &'static str {
        self.kind.as_str()
    }
    /// Sets the current learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    /// Sets the momentum of SGD-family groups; a no-op for groups without one (AdamW).
    pub fn set_momentum(&mut self, m: f64) {
        if let Some(x) = self.momentum.as_mut() {
            *x = m;
        }
    }
    /// The parameters' names.
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }
}

/// Splits `params` (named_parameters order) into the groups of `resolved.name` (§3.3):
/// MuSGD → 8 groups [weight+, weight, bn+, bn, bias+, bias, muon+, muon] (+ = boosted, lr ×3);
/// SGD/AdamW → 3 groups [weight (decay), bn, bias].
pub fn build_groups(
    params: &[(String, Tensor)],
    resolved: &ResolvedOptimizer,
    norm_modules: Option<&HashSet<String>>,
) -> Result<Vec<ParamGroup>> {
    let mut seen = HashSet::new();
    for (n, t) in params {
        if !seen.insert(n.as_str()) {
            return Err(TrainerError::InvalidArgument { what: "params", reason: format!("parameter `{n}` listed twice") });
        }
        if !t.dtype().is_float() {
            return Err(TrainerError::InvalidArgument {
                what: "params",
                reason: format!("parameter `{n}` has non-float dtype {}", t.dtype()),
            });
        }
    }
    let is_musgd = resolved.name == OptimizerName::MuSgd;
    let (momentum, betas) = match resolved.name {
        OptimizerName::AdamW => (None, Some((resolved.momentum, 0.999))),
        _ => (Some(resolved.momentum), None),
    };
    let lr0 = resolved.lr0;
    let make = |kind: ParamKind, boosted: bool| ParamGroup {
        kind,
        boosted,
        lr: if boosted { 3.0 * lr0 } else { lr0 },
        initial_lr: if boosted { 3.0 * lr0 } else { lr0 },
        momentum,
        betas,
        eps: 1e-8,
        weight_decay: if matches!(kind, ParamKind::Weight | ParamKind::Muon) { resolved.weight_decay } else { 0.0 },
        nesterov: !matches!(resolved.name, OptimizerName::AdamW),
        use_muon: kind == ParamKind::Muon,
        params: Vec::new(),
    };
    let kinds: Vec<ParamKind> = if is_musgd {
        vec![ParamKind::Weight, ParamKind::Bn, ParamKind::Bias, ParamKind::Muon]
    } else {
        vec![ParamKind::Weight, ParamKind::Bn, ParamKind::Bias]
    };
    let mut groups: Vec<ParamGroup> = Vec::new();
    for &k in &kinds {
        if is_musgd {
            groups.push(make(k, true));
        }
        groups.push(make(k, false));
    }
    for (name, t) in params {
        let kind = classify(name, t.dims(), is_musgd, norm_modules);
        let boosted = is_musgd && is_boosted(name);
        let gi = groups
            .iter()
            .position(|g| g.kind == kind && g.boosted == boosted)
            .ok_or_else(|| TrainerError::InvalidArgument { what: "params", reason: format!("no group for `{name}` ({kind:?})") })?;
        groups[gi].params.push(NamedParam { name: name.clone(), tensor: t.clone() });
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::OptimizerName;

    /// Ultralytics' spellings in any case; its optimizers ptl lacks are refused by name with the
    /// list of what exists.
    #[test]
    fn optimizer_names_parse_or_are_refused_naming_the_choices() {
        assert_eq!(OptimizerName::parse("SGD").unwrap(), OptimizerName::Sgd);
        assert_eq!(OptimizerName::parse("musgd").unwrap(), OptimizerName::MuSgd);
        assert_eq!(OptimizerName::parse(" AdamW ").unwrap(), OptimizerName::AdamW);
        for name in ["Adam", "NAdam", "RAdam", "RMSProp", "Adamax"] {
            let e = OptimizerName::parse(name).unwrap_err().to_string();
            assert!(e.contains(&format!("`{name}` is one of Ultralytics' optimizers")) && e.contains("auto, SGD, MuSGD or AdamW"), "{e}");
        }
        assert!(OptimizerName::parse("lion").unwrap_err().to_string().contains("unknown optimizer `lion`"));
    }
}
