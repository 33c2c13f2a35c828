//! A two-class pose dataset end to end on the CPU: `ptl train` builds a two-class model and
//! prints per-class rows after the last epoch, the checkpoints name both classes, `ptl val`
//! reports each class, `ptl predict` takes `classes=` and writes class ids, and `ptl export`
//! writes a file with two class scores.

mod common;

use std::path::Path;

use common::{ptl, synth, text};

/// Gives every second labelled person (in file order) class 1 and names it in the yaml.
fn two_classes(data: &Path) {
    let root = data.parent().expect("dataset folder");
    let mut row = 0usize;
    for split in ["train", "val"] {
        let dir = root.join("labels").join(split);
        let mut files: Vec<_> = std::fs::read_dir(&dir).expect("labels").flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).expect("label file");
            let lines: Vec<String> = text
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| {
                    let rest = l.split_once(' ').expect("a label row").1;
                    row += 1;
                    format!("{} {rest}", row % 2)
                })
                .collect();
            std::fs::write(&f, lines.join("\n") + "\n").expect("rewrite labels");
        }
    }
    let yaml = std::fs::read_to_string(data).expect("data.yaml");
    assert!(yaml.contains("names:\n  0: person\n"), "{yaml}");
    std::fs::write(data, yaml.replace("names:\n  0: person\n", "names:\n  0: person\n  1: robot\n")).expect("yaml");
}

#[test]
fn two_classes_train_validate_predict_and_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = synth(dir.path());
    two_classes(&data);
    let run = dir.path().join("runs/two");
    let o = ptl(
        &[
            "train",
            &format!("data={}", data.display()),
            "epochs=2",
            "batch=2",
            "imgsz=64",
            "max_batches=3",
            "optimizer=SGD",
            "plots=false",
            "device=cpu",
            &format!("save_dir={}", run.display()),
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{}", text(&o));
    // The last epoch's per-class rows under the "all" row.
    let out = text(&o);
    let row_of = |name: &str| out.lines().find(|l| l.trim_start().starts_with(&format!("{name} "))).map(str::to_string);
    for name in ["person", "robot"] {
        let row = row_of(name).unwrap_or_else(|| panic!("a {name} row after the last epoch:\n{out}"));
        assert_eq!(row.split_whitespace().count(), 11, "name, images, instances, 8 metrics: {row}");
    }
    // Checkpoints: a two-class model with both names.
    let best = run.join("weights/best.ckpt");
    for f in [&best, &run.join("weights/last.ckpt"), &run.join("weights/last_weights.ckpt")] {
        let m = ptl_trainer::fit::read_manifest(f).expect("manifest");
        assert_eq!(m.names, ["person", "robot"], "{}", f.display());
    }
    let (model, args) = ptl_trainer::pose::predict::load_eval_model(&best, ptl_autograd::Device::Cpu).expect("load");
    assert_eq!(model.head().nc, 2);
    assert_eq!(args["names"], serde_json::json!(["person", "robot"]));

    // Validation reports each class.
    let o = ptl(&["val", &format!("model={}", best.display()), &format!("data={}", data.display()), "plots=false"], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    for name in ["person", "robot"] {
        assert!(text(&o).lines().any(|l| l.trim_start().starts_with(&format!("{name} "))), "val names {name}:\n{}", text(&o));
    }

    // Prediction: each class's label rows, then classes=c keeps exactly those of class c (NMS is
    // per class and max_det is not reached); an id the model lacks is refused by name.
    let images = data.parent().expect("ds").join("images/val");
    let predict = |name: &str, extra: &[&str]| -> Vec<String> {
        let out = dir.path().join(name);
        let mut args = vec![
            "predict".to_string(),
            format!("model={}", best.display()),
            format!("source={}", images.display()),
            "conf=0.0001".into(),
            "save_txt=True".into(),
            format!("project={}", out.display()),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = ptl(&refs, dir.path());
        assert!(o.status.success(), "{}", text(&o));
        let mut files: Vec<_> = std::fs::read_dir(out.join("labels")).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        files.sort();
        files.iter().flat_map(|f| std::fs::read_to_string(f).expect("label file").lines().map(str::to_string).collect::<Vec<_>>()).collect()
    };
    let all = predict("pred_all", &[]);
    assert!(!all.is_empty(), "detections at conf 0.0001");
    for c in ["0", "1"] {
        let want: Vec<&String> = all.iter().filter(|l| l.split(' ').next() == Some(c)).collect();
        let got = predict(&format!("pred_{c}"), &[&format!("classes={c}")]);
        println!("class {c}: {} of {} rows", got.len(), all.len());
        assert_eq!(got.iter().collect::<Vec<_>>(), want, "classes={c}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("pred_all/predictions.json")).expect("json")).expect("JSON");
    let first = &json[0]["persons"][0];
    let class = first["class"].as_u64().expect("a class id") as usize;
    assert_eq!(first["name"].as_str(), Some(["person", "robot"][class]), "{first}");
    let o = ptl(&["predict", &format!("model={}", best.display()), &format!("source={}", images.display()), "classes=2"], dir.path());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("class 2 is not one of the model's 2 (person, robot)"), "{}", text(&o));

    // Export: two class scores per anchor (4 + 2 + 51 channels).
    let onnx = dir.path().join("two.onnx");
    let o =
        ptl(&["export", "format=onnx", &format!("model={}", best.display()), "imgsz=64", &format!("out={}", onnx.display())], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("output `decoded` (batch, 57, 84)"), "{}", text(&o));
    let bytes = std::fs::read(&onnx).expect("onnx file");
    let needle = b"{0: 'person', 1: 'robot'}";
    assert!(bytes.windows(needle.len()).any(|w| w == needle), "the file's names metadata");
}
