//! The stage tags of a training step ([`ptl_autograd::internal::stage`]): the fit runs each part of a step
//! under its tag so that a traced window's kernel time splits by stage, and the tape carries the
//! tag into backward (model backward vs loss backward).

use std::collections::BTreeMap;

use ptl_autograd::internal::stage::BACKWARD_OF;

use crate::fit::{KernelBreakdown, KernelRow, KernelShare};

/// The batch's upload.
pub const UPLOAD: u8 = 1;
/// The model's forward.
pub const FORWARD: u8 = 2;
/// The loss and assigner.
pub const LOSS: u8 = 3;
/// The `backward()` call itself (its seed and leaf accumulation); node backwards carry their own tags.
pub const BACKWARD: u8 = 4;
/// The optimizer step.
pub const OPTIMIZER: u8 = 5;
/// The EMA update.
pub const EMA: u8 = 6;
/// Validation after an epoch (the EMA model's forward over the validation set, metrics).
pub const VALIDATION: u8 = 7;

/// The stage name of a tag.
pub fn name(tag: u8) -> String {
    match tag {
        UPLOAD => "upload".into(),
        FORWARD => "model forward".into(),
        LOSS => "loss".into(),
        BACKWARD => "backward (engine)".into(),
        OPTIMIZER => "optimizer".into(),
        EMA => "EMA".into(),
        VALIDATION => "validation".into(),
        0 => "other".into(),
        t if t == FORWARD | BACKWARD_OF => "model backward".into(),
        t if t == LOSS | BACKWARD_OF => "loss backward".into(),
        t if t & BACKWARD_OF != 0 => format!("backward of {}", name(t & !BACKWARD_OF)),
        t => format!("stage {t}"),
    }
}

/// The op class of a kernel name: cuDNN and cuBLAS kernels by their libraries' naming, ptl's own
/// kernels (plain `extern "C"` names) by family — the name without its dtype suffix.
pub fn class(kernel: &str) -> String {
    let k = kernel.to_ascii_lowercase();
    if let Some(family) = own_family(kernel) {
        return family;
    }
    if ["cudnn", "conv", "fprop", "dgrad", "wgrad", "nchw", "nhwc"].iter().any(|p| k.contains(p)) {
        return "cuDNN".into();
    }
    if ["gemm", "cublas", "cutlass", "nvjet"].iter().any(|p| k.contains(p)) {
        return "cuBLAS".into();
    }
    let plain = !kernel.is_empty() && kernel.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !kernel.starts_with("_Z");
    if !plain {
        return "other library".into();
    }
    for suffix in ["_f32", "_f64", "_bf16", "_f16", "_u8", "_i64"] {
        if let Some(stem) = kernel.strip_suffix(suffix) {
            return stem.to_string();
        }
    }
    kernel.to_string()
}

/// A ptl kernel's family: a plain `extern "C"` name ending in its dtype suffix (`dw_wgrad_part_bf16`
/// → `dw_wgrad_part`), unless it reads as a library's (cuBLAS's and cuDNN's plain names carry
/// `xmma`, `gemm`, `cudnn` or an `sm<arch>_` prefix). Checked before the library words, so an own
/// convolution kernel is not counted as cuDNN's.
fn own_family(kernel: &str) -> Option<String> {
    let plain = !kernel.is_empty() && kernel.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !kernel.starts_with("_Z");
    let k = kernel.to_ascii_lowercase();
    let library = ["xmma", "gemm", "cudnn", "cublas", "cutlass", "nvjet"].iter().any(|p| k.contains(p))
        || (k.starts_with("sm") && k[2..].starts_with(|c: char| c.is_ascii_digit()));
    if !plain || library {
        return None;
    }
    ["_f32", "_f64", "_bf16", "_f16", "_u8", "_i64"].iter().find_map(|suffix| kernel.strip_suffix(suffix).map(str::to_string))
}

/// The breakdown of `detail` (a traced window of `steps` steps).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn breakdown(detail: &[(u8, String, u64, u64)], steps: usize) -> KernelBreakdown {
    let n = steps.max(1) as f64;
    let share = |m: BTreeMap<String, (u64, u64)>| -> Vec<KernelShare> {
        let mut v: Vec<KernelShare> = m
            .into_iter()
            .map(|(label, (count, ns))| KernelShare { label, ms_per_step: ns as f64 * 1e-6 / n, kernels_per_step: count as f64 / n })
            .collect();
        v.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step).then(a.label.cmp(&b.label)));
        v
    };
    let (mut by_stage, mut by_class, mut pairs) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    let mut top = Vec::new();
    for (tag, kernel, count, ns) in detail {
        let (stage, class) = (name(*tag), class(kernel));
        for (m, key) in [(&mut by_stage, stage.clone()), (&mut by_class, class.clone())] {
            let e: &mut (u64, u64) = m.entry(key).or_default();
            e.0 += count;
            e.1 += ns;
        }
        let e: &mut (u64, u64) = pairs.entry((stage.clone(), class.clone())).or_default();
        e.0 += count;
        e.1 += ns;
        top.push(KernelRow { stage, class, name: kernel.clone(), ms_per_step: *ns as f64 * 1e-6 / n, kernels_per_step: *count as f64 / n });
    }
    let row = |((stage, class), (count, ns)): ((String, String), (u64, u64))| KernelRow {
        stage,
        class,
        name: String::new(),
        ms_per_step: ns as f64 * 1e-6 / n,
        kernels_per_step: count as f64 / n,
    };
    let mut by_stage_class: Vec<KernelRow> = pairs.into_iter().map(row).collect();
    for v in [&mut by_stage_class, &mut top] {
        v.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step).then(a.name.cmp(&b.name)));
    }
    top.truncate(40);
    KernelBreakdown { by_stage: share(by_stage), by_class: share(by_class), by_stage_class, top }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_stage_names() {
        assert_eq!(class("reduce_rows_f32"), "reduce_rows");
        assert_eq!(class("binary_s_bf16"), "binary_s");
        assert_eq!(class("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nchw"), "cuDNN");
        assert_eq!(class("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32"), "cuBLAS");
        assert_eq!(class("_ZN7cutlass6KernelI..."), "cuBLAS");
        assert_eq!(class("_ZN3cub11DeviceReduceKernel"), "other library");
        // ptl's own convolution kernels are theirs, not cuDNN's; library plain names stay the library's.
        assert_eq!(class("dw_wgrad_part_bf16"), "dw_wgrad_part");
        assert_eq!(class("thin_weight_grad_part_f16"), "thin_weight_grad_part");
        assert_eq!(class("wgrad2d_shmem_tiling"), "cuDNN");
        assert_eq!(class("sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x32x64_f32"), "cuDNN");
        assert_eq!(class("nvjet_sm90_tss_64x8_64x16_1x4_h_bz_TNT"), "cuBLAS");
        assert_eq!(name(FORWARD | BACKWARD_OF), "model backward");
        assert_eq!(name(LOSS | BACKWARD_OF), "loss backward");
        assert_eq!(name(0), "other");
    }

    #[test]
    fn breakdown_sums_per_step_and_sorts() {
        let d = vec![
            (FORWARD, "unary_f32".to_string(), 20, 2_000_000),
            (FORWARD | BACKWARD_OF, "unary_f32".to_string(), 20, 6_000_000),
            (LOSS, "sm90_xmma_gemm_x".to_string(), 2, 1_000_000),
        ];
        let b = breakdown(&d, 2);
        assert_eq!(b.by_stage[0].label, "model backward");
        assert!((b.by_stage[0].ms_per_step - 3.0).abs() < 1e-12);
        assert_eq!(b.by_class[0].label, "unary");
        assert!((b.by_class[0].ms_per_step - 4.0).abs() < 1e-12 && (b.by_class[0].kernels_per_step - 20.0).abs() < 1e-12);
        assert_eq!(b.top.len(), 3);
        assert_eq!(b.by_stage_class[0].stage, "model backward");
    }
}
