//! A plugin from another crate (`ptl-example-plugin`, registered through inventory, no change to
//! ptl-trainer or ptl-plugins) is discovered by the `ptl-ext` binary and stacked with ptl's own
//! `feature` and `stem` plugins in a real fit; the fit's bytes equal native.

mod common;

use common::{ptl, summary, synth, text};

#[test]
fn a_third_party_plugin_is_discovered_and_stacked() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = synth(dir.path());
    let data = format!("data={}", yaml.display());
    let train = |project: &str, replay: &str| {
        let p = dir.path().join(project);
        let args = [
            "train",
            &data,
            "epochs=2",
            "batch=2",
            "imgsz=64",
            "max_batches=3",
            "optimizer=SGD",
            "plots=false",
            "workers=0",
            &format!("save_dir={}", p.display()),
            replay,
            "--device",
            "cpu",
        ];
        let o = ptl(&args, dir.path());
        assert!(o.status.success(), "{}", text(&o));
        (p, text(&o))
    };
    let (native, _) = train("native", "replay=");
    let (stacked, out) = train("stacked", "replay=feature,stem,count");
    assert!(out.contains("replay plugins: feature, stem, count"), "priority order (feature first, count last): {out}");
    assert!(out.contains("replay count: ") && out.contains("(forward 6, loss 6, backward 6, optimizer"), "one line per plugin: {out}");
    let (n, s) = (summary(&native), summary(&stacked));
    assert_eq!(n["hashes"], s["hashes"], "stacking plugins changes no byte");
    let counters = &s["replay_counters"];
    assert_eq!(counters["count"]["stages"], 6 * 3 + s["optimizer_steps"].as_u64().unwrap());
    assert!(counters["feature"]["trunk"]["replays"].as_u64().unwrap() >= 5, "{counters}");
    assert_eq!(counters["stem"].as_object().map(|m| m.len()), Some(18));
    // `replay=all` is ptl's own plugins only: the third-party one is enabled by its name.
    let (all, out) = train("all", "replay=all");
    assert!(
        out.contains("replay plugins: step, feature, stem, loss, ns, optimizer\n")
            || out.contains("replay plugins: step, feature, stem, loss, ns, optimizer\r"),
        "{out}"
    );
    assert_eq!(summary(&all)["hashes"], n["hashes"], "replay=all changes no byte");
    // An unknown plugin names the registered ones, the third-party one among them.
    let o = ptl(&["train", &data, "replay=nope", "--device", "cpu"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("\"count\"") && text(&o).contains("\"stem\""), "{}", text(&o));
}
