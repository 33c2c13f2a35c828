//! The replay plugins' invariants (issue "plugins I", point 3) on real CUDA graphs: the cases of
//! `invariants.rs` on the GPU. Without a usable GPU each test prints `skipping: <reason>` and passes.
#![cfg(feature = "cuda")]

mod cases;
mod common;

fn gpu() -> Option<ptl_autograd::Device> {
    ptl_autograd::cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}"))
}

invariant_tests!(gpu());
