//! The replay plugins' invariants (issue "plugins I", point 3) on the CPU: the recorder's test
//! double runs its real state machine (signatures, holds, fallbacks, retirements, counters); the
//! same cases run on real CUDA graphs in `cuda_invariants.rs`.

mod cases;
mod common;

invariant_tests!(Some(ptl_autograd::Device::Cpu));
