//! The rows each finished epoch prints, whether or not the output is a terminal (logs of CI jobs,
//! `nohup` and cluster runs), laid out as Ultralytics' per-epoch table: a header once, then per
//! epoch a training row (device memory, mean losses, the last batch's instances, the image size,
//! the epoch's time)
//! and the validation header and row (P, R, mAP50, mAP50-95 for boxes and keypoints).

/// The training columns after `Epoch` (the losses in `LOSS_NAMES` order).
const TRAIN_COLUMNS: [&str; 10] =
    ["GPU_mem", "box_loss", "pose_loss", "kobj_loss", "cls_loss", "l1_loss", "rle_loss", "Instances", "Size", "Time"];

pub(crate) use crate::fit::numbers::fmt_g;

/// The header of the training rows.
pub(crate) fn train_header() -> String {
    std::iter::once("Epoch").chain(TRAIN_COLUMNS).map(|c| format!("{c:>11}")).collect()
}

/// One epoch's training row: `epoch/epochs`, the device memory reserved (bytes, shown in GB as
/// Ultralytics does), the mean losses, the last batch's instances, the image size and the epoch's
/// seconds.
pub(crate) fn train_row(epoch: usize, epochs: usize, reserved: u64, losses: &[f64], instances: usize, imgsz: usize, secs: f64) -> String {
    let mut row = format!("{:>11}", format!("{}/{epochs}", epoch + 1));
    row += &format!("{:>11}", format!("{}G", fmt_g(reserved as f64 / 1e9, 3)));
    for v in losses {
        row += &format!("{:>11}", fmt_g(*v, 4));
    }
    row + &format!("{instances:>11}{imgsz:>11}{:>11}", format!("{secs:.1}s"))
}

/// The validation header and row: images and instances of the split, then P, R, mAP50 and
/// mAP50-95 for boxes and for keypoints (`metrics` in `ValResult::metric_names` order).
pub(crate) fn val_rows(images: usize, instances: usize, metrics: &[f64]) -> [String; 2] {
    let names = ["Images", "Instances", "Box(P", "R", "mAP50", "mAP50-95)", "Pose(P", "R", "mAP50", "mAP50-95)"];
    let header = format!("{:>22}", "Class") + &names.iter().map(|c| format!("{c:>11}")).collect::<String>();
    let mut row = format!("{:>22}{images:>11}{instances:>11}", "all");
    for v in metrics {
        row += &format!("{:>11}", fmt_g(*v, 3));
    }
    [header, row]
}

/// A class's row under the validation row (Ultralytics prints them after the last epoch when
/// the data has more than one class).
pub(crate) fn class_row(name: &str, images: usize, instances: usize, metrics: &[f64]) -> String {
    let mut row = format!("{name:>22}{images:>11}{instances:>11}");
    for v in metrics {
        row += &format!("{:>11}", fmt_g(*v, 3));
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_as_c_formats_them_with_g() {
        for (v, sig, want) in [
            (6.085905, 4, "6.086"),
            (104.147272, 4, "104.1"),
            (0.234479, 4, "0.2345"),
            (0.0003091, 3, "0.000309"),
            (0.3, 3, "0.3"),
            (0.0, 3, "0"),
            (12345.0, 4, "1.234e+04"),
            (0.00001234, 3, "1.23e-05"),
            (9.99996, 4, "10"),
            (-2.5, 3, "-2.5"),
        ] {
            assert_eq!(fmt_g(v, sig), want, "{v} with {sig} digits");
        }
    }

    #[test]
    fn rows_line_up_under_their_headers() {
        let h = train_header();
        let r = train_row(0, 2, 2_740_000_000, &[6.085905, 9.388644, 0.69759, 4.323826, 0.234479, 104.147272], 12, 64, 5.13);
        assert_eq!(h.len(), r.len(), "{h}\n{r}");
        assert_eq!(
            r,
            "        1/2      2.74G      6.086      9.389     0.6976      4.324     0.2345      104.1         12         64       5.1s"
        );
        assert!(h.starts_with("      Epoch    GPU_mem   box_loss"), "{h}");
        assert!(train_row(0, 1, 0, &[1.0], 1, 64, 0.0).contains("         0G"), "the CPU shows 0G");
        let [vh, vr] = val_rows(4, 10, &[0.006, 0.3, 0.002143, 0.000309, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(vh.len(), vr.len(), "{vh}\n{vr}");
        assert_eq!(vr, "                   all          4         10      0.006        0.3    0.00214   0.000309          0          0          0          0");
        let cr = class_row("dog", 3, 5, &[0.5, 0.25, 0.125, 0.0625, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(cr.len(), vr.len(), "{cr}");
        assert!(cr.starts_with("                   dog          3          5        0.5       0.25      0.125     0.0625"), "{cr}");
    }
}
