//! The model summary (used by the CLI), snapshot-tested.

use ptl_autograd::Device;
use ptl_heads::{ModelConfig, ModelSummary, PoseModel};

#[test]
fn yolo26n_pose_summary_snapshot() {
    let m = PoseModel::new(ModelConfig::default(), Device::Cpu, 0).expect("build");
    let s = ModelSummary::new(&m, 640);
    assert_eq!(s.num_params, 3_679_464);
    assert_eq!(s.num_parameter_tensors, 498);
    assert_eq!(s.num_buffers, 381);
    // docs/model.md §1/§8: 2,926,494 deployed parameters; 5.119 G training-graph conv MACs at 640.
    assert_eq!(s.deploy_params, 2_926_494);
    assert!((s.conv_macs as f64 / 1e9 - 5.119).abs() < 1e-3, "conv MACs {}", s.conv_macs);
    assert_eq!(s.stems.len(), 30);
    assert_eq!(s.layers.last().map(|l| l.out_shape.clone()), Some(vec![1, 56, 8400]));
    insta::assert_snapshot!(s.to_string());
}
