//! Plain box IoU in float32 (Ultralytics `box_iou`, docs/metrics.md §3.1).

/// IoU matrix `(gt.len(), pred.len())`, row-major, boxes xyxy.
///
/// Operation order follows the reference (`inter / (area_g + area_p − inter + 1e-7)`) so that
/// values land on the same float32 as torch and threshold decisions agree.
pub fn box_iou(gt: &[[f32; 4]], pred: &[[f32; 4]]) -> Vec<f32> {
    let mut out = Vec::with_capacity(gt.len() * pred.len());
    for a in gt {
        let area_a = (a[2] - a[0]) * (a[3] - a[1]);
        for b in pred {
            let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
            let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
            let inter = w * h;
            let area_b = (b[2] - b[0]) * (b[3] - b[1]);
            out.push(inter / (area_a + area_b - inter + 1e-7));
        }
    }
    out
}

/// IoU of two boxes as torchvision's CPU NMS computes it (no eps).
pub(crate) fn nms_iou(a: &[f32; 4], area_a: f32, b: &[f32; 4], area_b: f32) -> f32 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    inter / (area_a + area_b - inter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iou_basic() {
        let g = [[10.0, 10.0, 50.0, 50.0]];
        let p = [[15.0, 15.0, 55.0, 55.0], [100.0, 100.0, 110.0, 110.0]];
        let m = box_iou(&g, &p);
        assert!((m[0] - 1225.0 / 1975.0).abs() < 1e-6);
        assert_eq!(m[1], 0.0);
    }
}
