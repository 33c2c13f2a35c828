//! AutoBatch's batch choice against Ultralytics 8.4.190's own `autobatch()` on the same probe
//! measurements (`fixtures/autobatch/make_autobatch.py` ran it with stand-ins for the GPU and the
//! profiler and wrote what it chose).

use ptl_trainer::pose::autobatch::{choose_batch, probe_sizes, DeviceMemory, Probe};

const GIB: f64 = (1u64 << 30) as f64;

#[test]
fn choose_batch_matches_ultralytics_autobatch() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/autobatch/autobatch_cases.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "the fixture holds the cases");
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let bytes = |k: &str| (c[k].as_f64().unwrap() * GIB) as u64;
        let mem = DeviceMemory { total: bytes("total_gib"), reserved: bytes("reserved_gib"), free: bytes("free_gib") };
        let dataset = c["dataset_size"].as_u64().unwrap() as usize;
        let sizes = probe_sizes(mem.total, dataset);
        let probed: Vec<usize> = c["probed"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        assert_eq!(sizes, probed, "{name}: probed sizes");
        let probes: Vec<Probe> = sizes
            .iter()
            .zip(c["memory_gib"].as_array().unwrap())
            .map(|(&batch, m)| Probe { batch, bytes: m.as_f64().map(|g| (g * GIB).round() as u64) })
            .collect();
        let got = choose_batch(&probes, mem, c["fraction"].as_f64().unwrap(), dataset).unwrap();
        assert_eq!(got.batch as u64, c["batch"].as_u64().unwrap(), "{name}: Ultralytics chose {}, ptl {}", c["batch"], got.batch);
    }
}
