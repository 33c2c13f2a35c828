//! `replay=optimizer`: the device parts of the optimizer step — gradient clipping with the SGD /
//! MuSGD / AdamW update (Newton–Schulz included) and, under 16-mixed, the unscale + inf check before it and
//! the scaler's growth/backoff in it (the skip decided on the device), one recorded region per
//! part and gradient-presence mask; and the EMA update, one region.
//! What makes it recordable: the step's scalars live on the device (the optimizer's host part
//! writes them before the region, `Optimizer::prepare_step`), the gradients have fixed buffers
//! (the plugin asks for persistent gradients), and the recorder's warmup rolls back everything the
//! update writes (parameters, moments, step counts, scaler state: the write journal). SGD, MuSGD
//! and AdamW qualify; the trainer hands over only a step that does (`Optimizer::is_capturable`).

use ptl_autograd::{Tensor, TensorKind};
use ptl_capture::RecorderConfig;
use ptl_trainer::fit::{PluginRegistration, PluginSetup, ReplayPlugin, Site, SiteBody, SiteCall, SiteRunner, UpdatePart};

use crate::keyed::{region_body, HoldsRegions, KeyedRegions, PluginShell};

/// A region's key: the part, and for the step which parameters have a gradient.
type PartKey = (UpdatePart, Vec<bool>);

/// The plugin's recorder and its regions: the step's, one per gradient-presence mask, and the
/// EMA update's.
struct UpdateRegions {
    regions: KeyedRegions<PartKey>,
    params: Vec<(String, Tensor)>,
    ema: Vec<(String, Tensor)>,
    /// Surface names, made once per fit (not per step): `<param>.grad`, `ema.<name>`.
    grad_names: Vec<String>,
    ema_names: Vec<String>,
}

/// The `optimizer` replay plugin. Configuration: `ptl_capture::RecorderConfig` fields as JSON over
/// [`crate::plugin_defaults`].
#[derive(Clone)]
pub struct UpdateReplay {
    shell: PluginShell<UpdateRegions>,
}

impl HoldsRegions for UpdateRegions {
    type Key = PartKey;
    fn keyed(&self) -> &KeyedRegions<PartKey> {
        &self.regions
    }
}

impl UpdateReplay {
    /// The plugin's name in `replay=`.
    pub const NAME: &'static str = "optimizer";

    /// The plugin with `config` for the recorders of the optimizer update and the EMA.
    pub fn new(config: RecorderConfig) -> UpdateReplay {
        UpdateReplay { shell: PluginShell::new(config) }
    }

    fn from_config(cfg: &serde_json::Value) -> ptl_trainer::Result<Box<dyn ReplayPlugin>> {
        Ok(Box::new(UpdateReplay { shell: PluginShell::from_config(Self::NAME, cfg)? }))
    }
}

impl UpdateRegions {
    fn run(&self, part: UpdatePart, body: &mut SiteBody<'_>) -> ptl_trainer::Result<()> {
        // What the part reads and writes in place — the step: the parameters and their
        // (persistent) gradients; the EMA: the parameters and the EMA's tensors. Their addresses
        // key the recording (a moved buffer retires it).
        let mut surface: Vec<(String, Tensor, TensorKind)> = Vec::with_capacity(2 * self.params.len());
        let reads_grads = matches!(part, UpdatePart::Unscale | UpdatePart::Step);
        let mask: Vec<bool> = match reads_grads {
            true => self.params.iter().map(|(_, p)| p.grad().is_some()).collect(),
            false => Vec::new(),
        };
        for ((name, p), grad_name) in self.params.iter().zip(&self.grad_names) {
            surface.push((name.clone(), p.detach(), TensorKind::Buffer));
            if let (true, Some(g)) = (reads_grads, p.grad()) {
                surface.push((grad_name.clone(), g, TensorKind::Buffer));
            }
        }
        if part == UpdatePart::Ema {
            surface.extend(self.ema.iter().zip(&self.ema_names).map(|((_, t), n)| (n.clone(), t.clone(), TensorKind::Buffer)));
        }
        let region = self.regions.region((part, mask), |made| match part {
            UpdatePart::Unscale => format!("unscale.{}", made.keys().filter(|k| k.0 == UpdatePart::Unscale).count()),
            UpdatePart::Step => format!("update.{}", made.keys().filter(|k| k.0 == UpdatePart::Step).count()),
            UpdatePart::Ema => "ema".to_string(),
        });
        // The step's Newton–Schulz (a nested site) runs inside this region — warm-up, recording
        // and replay alike — not through `replay=ns`'s own regions: they would only ever see the
        // warm-up.
        let run = region_body(body, "optimizer update part");
        ptl_autograd::no_grad(|| region.call_with(&[], &surface, &run))
            .map(|_| ())
            .map_err(|e| ptl_trainer::TrainerError::InvalidArgument { what: "optimizer replay", reason: e.to_string() })
    }
}

impl ReplayPlugin for UpdateReplay {
    fn name(&self) -> &'static str {
        Self::NAME
    }
    fn priority(&self) -> i32 {
        20
    }
    fn setup(&mut self, ctx: &PluginSetup<'_>) -> ptl_trainer::Result<()> {
        let names = |prefix: &str, suffix: &str, ts: &[(String, Tensor)]| ts.iter().map(|(n, _)| format!("{prefix}{n}{suffix}")).collect();
        let ema = ctx.ema.ema_tensors();
        // With several ranks the update's graphs hold the gradients' collectives, whose buffers
        // NCCL may register: they keep an arena of their own, never set aside and mapped anew.
        let config = RecorderConfig { take_turns: self.shell.config.take_turns && ctx.ranks == 1, ..self.shell.config.clone() };
        let regions = UpdateRegions {
            regions: KeyedRegions::new(&config, ctx.device, self.shell.inject_capture_failures),
            grad_names: names("", ".grad", ctx.params),
            ema_names: names("ema.", "", ema),
            params: ctx.params.to_vec(),
            ema: ema.to_vec(),
        };
        self.shell.install(regions);
        Ok(())
    }
    fn persistent_gradients(&self) -> bool {
        true
    }
    fn claims(&self, site: Site) -> bool {
        matches!(site, Site::Update(_)) && self.shell.active().is_some()
    }
    fn run(&self, call: SiteCall<'_>, body: &mut SiteBody<'_>, rest: &dyn SiteRunner) -> ptl_trainer::Result<Vec<Tensor>> {
        match (self.shell.active(), call.site) {
            (Some(r), Site::Update(part)) => r.run(part, body).map(|()| Vec::new()),
            _ => body(rest, call.inputs),
        }
    }
    fn on_fit_end(&self) {
        self.shell.release();
    }
    fn cadence(&self) -> ptl_trainer::fit::ReplayCadence {
        ptl_trainer::fit::ReplayCadence::PerOptimizerStep
    }
    fn summary(&self) -> Option<String> {
        self.shell.summary()
    }
    fn counters(&self) -> serde_json::Value {
        self.shell.counters()
    }
    fn state(&self) -> serde_json::Value {
        self.shell.state()
    }
    fn load_state(&mut self, state: &serde_json::Value) -> ptl_trainer::Result<()> {
        self.shell.load_state(Self::NAME, state)
    }
}

inventory::submit! {
    PluginRegistration { name: UpdateReplay::NAME, in_all: true, create: UpdateReplay::from_config }
}
