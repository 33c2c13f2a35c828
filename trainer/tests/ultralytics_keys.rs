//! The key walk: every key of Ultralytics 8.4.190's `cfg/default.yaml` (its list with the default
//! values, `fixtures/ultralytics-8.4.190-default-keys.txt`) given to `ptl train` is taken with its
//! meaning or refused with a reason that names it — never "unknown key".

use ptl_trainer::pose::{foreign_keys, PoseTrainConfig};

/// (key, Ultralytics' default value) in the file's order.
fn ultralytics_keys() -> Vec<(String, String)> {
    let text = include_str!("fixtures/ultralytics-8.4.190-default-keys.txt");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("fixture line `{l}`"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// The one non-empty Ultralytics default ptl refuses: the default task is detection. (A key whose
/// default is empty may be refused where ptl needs a value, as `model=` with nothing after it.)
const DEFAULT_REFUSED: [&str; 1] = ["task"];

#[test]
fn every_ultralytics_key_is_taken_or_refused_by_name() {
    let keys = ultralytics_keys();
    assert!(keys.len() >= 110, "the fixture lists {} keys", keys.len());
    let ptl: Vec<&str> = PoseTrainConfig::keys().iter().map(|(k, _, _)| *k).collect();
    let foreign: Vec<&str> = foreign_keys::keys().collect();
    let mut taken = 0;
    for (key, default) in &keys {
        // Ultralytics' spelling of one of ptl's keys, or one of the table's.
        let known = ptl.contains(&key.as_str()) || foreign.contains(&key.as_str()) || ["amp", "verbose"].contains(&key.as_str());
        assert!(known, "`{key}` is neither a ptl key nor answered by the foreign-key table");
        let mut cfg = PoseTrainConfig::default();
        match cfg.set(key, default) {
            Ok(()) => taken += 1,
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(key.as_str()) && !e.contains("unknown key"), "`{key}={default}`: {e}");
                assert!(
                    default.is_empty() || DEFAULT_REFUSED.contains(&key.as_str()),
                    "Ultralytics' default `{key}={default}` refused: {e}"
                );
            }
        }
        if foreign.contains(&key.as_str()) {
            let e = PoseTrainConfig::default().set(key, "not-a-value-ptl-takes").expect_err(key).to_string();
            assert!(e.contains(key.as_str()) && e.contains("ptl does not take"), "{e}");
        }
    }
    println!("{taken} of {} Ultralytics defaults taken as they are; the rest name their key", keys.len());
}

/// Ultralytics' AutoBatch spellings: `batch=-1` and a fraction in (0, 1) are taken and resolved
/// with the device — on the CPU Ultralytics' default 16, on a CUDA device left to the fit, which
/// probes the device (`pose::autobatch`) — and a later `batch=N` wins.
#[test]
fn autobatch_spellings_resolve_with_the_device() {
    use ptl_autograd::Device;
    let mut cpu = PoseTrainConfig { device: Device::Cpu, batch: 4, ..PoseTrainConfig::default() };
    cpu.set("batch", "-1").unwrap();
    cpu.resolve_autobatch().unwrap();
    assert_eq!(cpu.batch, 16);
    let mut gpu = PoseTrainConfig { device: Device::Cuda(0), ..PoseTrainConfig::default() };
    gpu.set("batch", "0.7").unwrap();
    gpu.resolve_autobatch().unwrap();
    assert_eq!(gpu.autobatch, Some(0.7), "on CUDA the fit probes the device: the request stays pending");
    let mut later = PoseTrainConfig { device: Device::Cuda(0), ..PoseTrainConfig::default() };
    later.set("batch", "-1").unwrap();
    later.set("batch", "8").unwrap();
    later.resolve_autobatch().unwrap();
    assert_eq!(later.batch, 8, "a batch size given after batch=-1 wins");
    assert!(PoseTrainConfig::default().set("batch", "-2").is_err());
}
