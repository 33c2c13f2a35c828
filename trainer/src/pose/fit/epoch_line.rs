//! The line each finished epoch prints, whether or not the output is a terminal (logs of CI jobs,
//! `nohup` and cluster runs): its place and time, the mean training losses, the validation
//! metrics for boxes and keypoints and the learning rate — what Ultralytics' per-epoch rows tell.

/// Short names of the training losses, in `LOSS_NAMES` order.
const LOSSES: [&str; 6] = ["box", "pose", "kobj", "cls", "l1", "rle"];

/// `epoch 3/100 12.4 s  box 1.234 pose … rle 0.321 | Box P 0.001 R 0.036 mAP50 0.000 mAP50-95 0.000
/// | Pose P … | lr 0.00123`. `losses` in `LOSS_NAMES` order; `metrics` in `ValResult::metric_names`
/// order (boxes, then keypoints), `None` without validation.
pub(crate) fn epoch_line(epoch: usize, epochs: usize, secs: f64, losses: &[f64], metrics: Option<&[f64]>, lr: Option<f64>) -> String {
    let mut line = format!("epoch {}/{epochs} {secs:.1} s ", epoch + 1);
    for (name, v) in LOSSES.iter().zip(losses) {
        line += &format!(" {name} {v:.4}");
    }
    if let Some(m) = metrics {
        for (label, part) in ["Box", "Pose"].iter().zip(m.chunks(4)) {
            line += &format!(" | {label}");
            for (name, v) in ["P", "R", "mAP50", "mAP50-95"].iter().zip(part) {
                line += &format!(" {name} {v:.4}");
            }
        }
    }
    if let Some(lr) = lr {
        line += &format!(" | lr {lr:.6}");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_names_every_loss_and_both_metric_sets() {
        let losses = [1.23456, 2.0, 0.5, 1.0, 0.25, 0.125];
        let metrics = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8];
        assert_eq!(
            epoch_line(2, 100, 12.44, &losses, Some(&metrics), Some(0.00123)),
            "epoch 3/100 12.4 s  box 1.2346 pose 2.0000 kobj 0.5000 cls 1.0000 l1 0.2500 rle 0.1250 \
             | Box P 0.1000 R 0.2000 mAP50 0.3000 mAP50-95 0.4000 | Pose P 0.5000 R 0.6000 mAP50 0.7000 mAP50-95 0.8000 | lr 0.001230"
        );
        assert_eq!(epoch_line(0, 1, 0.0, &losses[..1], None, None), "epoch 1/1 0.0 s  box 1.2346");
    }
}
