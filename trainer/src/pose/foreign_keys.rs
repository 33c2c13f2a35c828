//! Ultralytics' settings (`cfg/default.yaml` of 8.4.190) that `ptl train` has no key of its own
//! for. Each takes the values that change nothing in ptl — Ultralytics' default, or what ptl
//! always does — and any other value is refused with the reason, so that a command line or
//! `args.yaml` written for Ultralytics either means the same here or says what differs: never
//! "unknown key", never a silent run without it.

/// A key, the values (lower case; `""` for none) that are no-ops in ptl, and why another is refused.
type Foreign = (&'static str, &'static [&'static str], &'static str);

const PREDICT: &str = "a prediction setting: `ptl predict` takes it";
const EXPORT: &str =
    "an export setting: `ptl export` takes it (format=onnx, model, imgsz, half, opset, nms, conf, iou, max_det, dynamic, simplify, out)";
const EXPORT_OTHER: &str = "a setting of Ultralytics' TorchScript/TensorRT exports: ptl exports ONNX";
const TRACK: &str = "a tracking or streaming setting: ptl predicts on images, with no tracker or video";
const SEGMENT: &str = "a segmentation setting: ptl trains pose models";
const CLASSIFY: &str = "a classification setting: ptl trains pose models";
const DISTILL: &str = "a distillation setting: knowledge distillation is not implemented";

/// Ultralytics keys `ptl train` has none of.
const FOREIGN: [Foreign; 57] = [
    ("task", &["pose"], "ptl trains pose models only (task=pose)"),
    ("mode", &["train"], "`ptl train` is the train mode; the others are `ptl val`, `ptl predict` and `ptl export`"),
    ("time", &[""], "a time budget is not implemented: set epochs"),
    ("save", &["true"], "ptl always writes weights/last.ckpt (the resumable checkpoint), last_weights.ckpt and best.ckpt"),
    ("cache", &["false"], "image caching is not implemented: the loader's workers decode the images every epoch"),
    ("pretrained", &["true"], "start weights come from model= (a ptl .ckpt or a .safetensors state dict)"),
    ("cls_remap", &["true"], "class remapping is not implemented: the data's class ids are the model's"),
    (
        "deterministic",
        &["true"],
        "ptl's training is always deterministic (a fixed seed gives the same bytes); there is no nondeterministic mode",
    ),
    ("single_cls", &["false"], "merging classes into one is not implemented: the model has the data's nc classes"),
    ("rect", &["false"], "rectangular training batches are not implemented"),
    ("multi_scale", &["0", "false"], "multi-scale training is not implemented"),
    ("compile", &["false"], "ptl has no torch.compile; its own speed-up is replay= (the step recorded as CUDA graphs)"),
    ("overlap_mask", &["true"], SEGMENT),
    ("mask_ratio", &["4"], SEGMENT),
    ("retina_masks", &["false"], SEGMENT),
    ("copy_paste_mode", &["flip"], "CopyPaste is not implemented (copy_paste takes only 0)"),
    ("dropout", &["0"], CLASSIFY),
    ("auto_augment", &["randaugment"], CLASSIFY),
    ("erasing", &["0.4"], CLASSIFY),
    ("split", &["val"], "validation during training uses the data yaml's val split"),
    ("conf", &[""], "validation keeps every prediction above Ultralytics' 0.001, as it does; the prediction threshold is `ptl predict`'s"),
    ("iou", &["0.7"], "validation's IoU threshold is Ultralytics' 0.7, fixed"),
    ("max_det", &["300"], "validation keeps at most Ultralytics' 300 detections per image, fixed"),
    ("quantize", &[""], "quantisation (and quantisation-aware training) is not implemented"),
    ("dnn", &["false"], "OpenCV DNN inference is not implemented"),
    ("nms", &["", "false"], EXPORT),
    ("source", &[""], PREDICT),
    ("vid_stride", &["1"], TRACK),
    ("stream_buffer", &["false"], TRACK),
    ("visualize", &["false"], "feature visualisation is not implemented"),
    ("augment", &["false"], "test-time augmentation is not implemented"),
    ("agnostic_nms", &["false"], "one class: class-agnostic NMS changes nothing, and another value is refused"),
    ("classes", &[""], PREDICT),
    ("embed", &[""], PREDICT),
    ("show", &["false"], PREDICT),
    ("save_frames", &["false"], TRACK),
    ("save_txt", &["false"], PREDICT),
    ("save_conf", &["false"], PREDICT),
    ("save_crop", &["false"], PREDICT),
    ("show_labels", &["true"], PREDICT),
    ("show_conf", &["true"], PREDICT),
    ("show_boxes", &["true"], PREDICT),
    ("line_width", &[""], PREDICT),
    ("format", &["torchscript", "onnx"], EXPORT),
    ("optimize", &["false"], EXPORT_OTHER),
    ("dynamic", &["false"], EXPORT),
    ("simplify", &["true"], EXPORT),
    ("opset", &[""], EXPORT),
    ("workspace", &[""], EXPORT_OTHER),
    ("distill_model", &[""], DISTILL),
    ("dis", &["6"], DISTILL),
    ("dlog", &["1"], DISTILL),
    ("dgrad", &["0.5"], DISTILL),
    ("dlam", &["1"], DISTILL),
    ("cls_pw", &["0"], "a classification loss weight ptl's pose loss does not have"),
    ("angle", &["1"], "an oriented-box loss gain: ptl trains pose models"),
    ("cfg", &[""], "a configuration file is `ptl train file.yaml` (its keys, then key=value on top)"),
];

/// Tracking's tracker file (the default, `tracktrack.yaml`, and the other one Ultralytics ships).
const TRACKER: Foreign = ("tracker", &["tracktrack.yaml", "botsort.yaml", "bytetrack.yaml"], TRACK);

/// `Some(Ok(()))`: `key` is one of Ultralytics' keys ptl has none of and `value` changes nothing
/// here; `Some(Err(reason))`: it would, and cannot (the reason names the key); `None`: not such a key.
pub fn check(key: &str, value: &str) -> Option<std::result::Result<(), String>> {
    let (_, no_ops, why) = FOREIGN.iter().chain(std::iter::once(&TRACKER)).find(|(k, _, _)| *k == key)?;
    let v = normalised(value);
    let same = |n: &str| n == v || matches!((n.parse::<f64>(), v.parse::<f64>()), (Ok(a), Ok(b)) if a == b);
    Some(match no_ops.iter().any(|n| same(n)) {
        true => Ok(()),
        false => Err(format!("`{key}={value}` is an Ultralytics setting ptl does not take: {why}")),
    })
}

/// Lower case, with the words for "nothing" as the empty string.
fn normalised(value: &str) -> String {
    let v = value.trim().to_ascii_lowercase();
    match v.as_str() {
        "none" | "null" | "~" => String::new(),
        _ => v,
    }
}

/// The keys of the table (for `ptl cfg`'s list and the key walk).
pub fn keys() -> impl Iterator<Item = &'static str> {
    FOREIGN.iter().chain(std::iter::once(&TRACKER)).map(|(k, _, _)| *k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_op_values_pass_and_others_name_the_key() {
        assert_eq!(check("deterministic", "True"), Some(Ok(())));
        assert_eq!(check("multi_scale", "0"), Some(Ok(())), "0 and 0.0 are one number");
        assert_eq!(check("source", "None"), Some(Ok(())));
        let e = check("deterministic", "False").unwrap().unwrap_err();
        assert!(e.contains("deterministic=False") && e.contains("always deterministic"), "{e}");
        assert!(check("cache", "ram").unwrap().is_err());
        assert_eq!(check("epochs", "3"), None, "a key of ptl's own");
        let mut seen = std::collections::HashSet::new();
        assert!(keys().all(|k| seen.insert(k)), "each key once");
    }
}
