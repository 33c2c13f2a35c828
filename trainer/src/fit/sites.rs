//! The sites of a training step: the places a plugin may run in the trainer's stead.
//!
//! Each site is a body — inputs in, outputs out — plus the surface it reads besides its inputs
//! (the parameters and buffers a recording must watch). The trainer hands every site to a
//! [`SiteRunner`]: the plugin stack gives it to the first plugin that claims it, or runs it
//! natively. A body receives the runner for the sites nested in it (the Newton–Schulz inside an
//! optimizer update): a plugin that records a body passes [`NativeSites`], so nothing is recorded
//! twice; one that runs it natively passes the stack on.

use ptl_autograd::{Tensor, TensorKind};
use ptl_heads::Piece;

use crate::Result;

/// The device parts of an optimizer step (sites [`Site::Update`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UpdatePart {
    /// 16-mixed only: every present gradient × 1/scale and the found-inf flag
    /// (`GradScaler::unscale_grads`), before the `on_before_optimizer_step` callbacks.
    Unscale,
    /// Gradient clipping and the optimizer's update (`Optimizer::step_prepared`); under 16-mixed
    /// the update skipped on the device by the found-inf flag (`Optimizer::step_prepared_unless`)
    /// and the scaler's growth/backoff (`GradScaler::update_scale`). Offered only for an
    /// optimizer that `Optimizer::is_capturable` (SGD, MuSGD, AdamW).
    Step,
    /// The EMA update (`ModelEma::update_prepared`), after zero-grad.
    Ema,
}

/// A place in a training step whose work a plugin may run (natively, or by replaying a recording
/// of it); every site's body must give the same outputs either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Site {
    /// A piece of the model: the trunk, or one of the head's 18 stems. Inputs: the piece's inputs;
    /// surface: the piece's parameters and buffers.
    Piece(Piece),
    /// The dense criterion's device work (both branches' assignment and terms, the RLE flow, the
    /// mix; `crate::loss::E2ELoss::loss_routed`). Inputs: the two branches' raw outputs, the padded
    /// device targets and the branch weights; surface: the RLE flow's parameters.
    Loss,
    /// A step's model forward and dense criterion as one body (`E2ELoss::loss_with_forward`).
    /// Inputs: the images, the padded device targets and the branch weights; surface: every
    /// parameter and buffer of the model. Offered only on the dense criterion when the batch's
    /// targets fit a bucket; otherwise the step goes through the pieces and [`Site::Loss`].
    ForwardLoss,
    /// A device part of an optimizer step, after its host part wrote the step's scalars to the
    /// device. No tensor inputs or outputs: it updates the parameters, their state, the scaler and
    /// the EMA in place.
    Update(UpdatePart),
    /// One Muon group's Newton–Schulz: inputs the group's momentum blends as matrices, outputs
    /// their orthogonalised, scaled updates (nested in [`Site::Update`]`(Step)`).
    NewtonSchulz,
}

/// Named tensors a site's body reads besides its inputs.
pub type Surface = [(String, Tensor, TensorKind)];

/// A site's work: given the runner for the sites nested in it, and its inputs, its outputs.
pub type SiteBody<'a> = dyn FnMut(&dyn SiteRunner, &[Tensor]) -> Result<Vec<Tensor>> + 'a;

/// Runs sites: natively, or through whatever claims them.
pub trait SiteRunner {
    /// Runs `site`'s `body` on `inputs` (reading `surface`) and returns its outputs.
    fn run_site(&self, site: Site, inputs: &[Tensor], surface: &Surface, body: &mut SiteBody<'_>) -> Result<Vec<Tensor>>;
}

/// Runs every site natively (what a recorded body's nested sites get).
pub struct NativeSites;

impl SiteRunner for NativeSites {
    fn run_site(&self, _site: Site, inputs: &[Tensor], _surface: &Surface, body: &mut SiteBody<'_>) -> Result<Vec<Tensor>> {
        body(&NativeSites, inputs)
    }
}

/// The Newton–Schulz site as the optimizer calls it (`crate::optim::NsRunner`).
pub struct NsSite<'a>(pub &'a dyn SiteRunner);

impl crate::optim::NsRunner for NsSite<'_> {
    fn run_ns(&self, matrices: &[Tensor], body: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        self.0.run_site(Site::NewtonSchulz, matrices, &[], &mut |_, xs| body(xs))
    }
}
