//! The replay seam: a forward runs the trunk and the 18 stems through the caller's runner, in a
//! fixed order, with what each piece reads named by `piece_surface`.

use std::cell::RefCell;
use std::collections::HashSet;

use ptl_autograd::{DType, Device, Module, Tensor};
use ptl_heads::{Branch, ModelConfig, Piece, PieceBody, PieceRunner, PoseModel, Result, Scale, StemKind};

fn model() -> PoseModel {
    PoseModel::new(ModelConfig { nc: 1, kpt_shape: (17, 3), scale: Scale::N }, Device::Cpu, 5).expect("model")
}

fn image() -> Tensor {
    let mut rng = ptl_autograd::Rng::new(3);
    Tensor::rand(vec![2, 3, 64, 64], 0.0, 1.0, DType::F32, Device::Cpu, &mut rng).expect("image")
}

/// Runs each body natively and notes the piece, whether its inputs need a gradient and how many
/// outputs it returned.
#[derive(Default)]
struct Logging {
    seen: RefCell<Vec<(Piece, Vec<bool>, usize)>>,
}

impl PieceRunner for Logging {
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> Result<Vec<Tensor>> {
        let out = body(inputs)?;
        self.seen.borrow_mut().push((piece, inputs.iter().map(Tensor::requires_grad).collect(), out.len()));
        Ok(out)
    }
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_bytes().expect("bytes")
}

#[test]
fn a_forward_runs_every_piece_through_the_runner_in_native_order() {
    let m = model();
    let x = image();
    let native = m.forward(&x).expect("native");
    let log = Logging::default();
    let out = m.forward_with(&x, &log).expect("through the runner");
    for (a, b) in [(&native.one2many, &out.one2many), (&native.one2one, &out.one2one)] {
        assert_eq!(bytes(&a.boxes), bytes(&b.boxes));
        assert_eq!(bytes(&a.scores), bytes(&b.scores));
        assert_eq!(bytes(&a.kpts), bytes(&b.kpts));
        assert_eq!(bytes(a.kpts_sigma.as_ref().unwrap()), bytes(b.kpts_sigma.as_ref().unwrap()));
    }
    let seen = log.seen.borrow();
    let order: Vec<Piece> = seen.iter().map(|(p, _, _)| *p).collect();
    assert_eq!(order, Piece::all(3), "trunk, then (branch, level, kind)");
    for (piece, needs_grad, outputs) in seen.iter() {
        match piece {
            Piece::Trunk => assert_eq!((needs_grad.as_slice(), *outputs), (&[false][..], 3)),
            Piece::Stem { branch, kind, .. } => {
                // One-to-many stems read the live features, one-to-one stems detached copies.
                assert_eq!(needs_grad, &vec![*branch == Branch::OneToMany], "{piece}");
                assert_eq!(*outputs, if *kind == StemKind::Point { 2 } else { 1 }, "{piece}: keypoints + sigma in training");
            }
        }
    }
}

#[test]
fn point_pieces_drop_the_sigma_view_in_eval() {
    let mut m = model();
    m.set_training(false);
    let log = Logging::default();
    m.forward_with(&image(), &log).expect("eval forward");
    assert!(log.seen.borrow().iter().filter(|(p, _, _)| matches!(p, Piece::Stem { kind: StemKind::Point, .. })).all(|(_, _, n)| *n == 1));
}

#[test]
fn piece_surfaces_cover_the_model_once() {
    let m = model();
    let mut covered = HashSet::new();
    for piece in Piece::all(3) {
        let s = m.piece_surface(piece);
        assert!(!s.is_empty(), "{piece} reads parameters");
        for (name, _, _) in s.iter() {
            assert!(covered.insert(name.clone()), "{name} belongs to two pieces");
        }
    }
    let all: HashSet<String> = ptl_autograd::module::state_dict(&m).into_iter().map(|(n, _, _)| n).collect();
    let rest: Vec<&String> = all.difference(&covered).collect();
    assert!(rest.iter().all(|n| n.contains("flow_model")), "only the loss's flow is outside every piece: {rest:?}");
    assert!(covered.is_subset(&all), "surface names are state-dict names");
    let point = m.piece_surface(Piece::Stem { branch: Branch::OneToOne, level: 2, kind: StemKind::Point });
    assert!(point.iter().any(|(n, _, _)| n == "model.23.one2one_cv4_kpts.2.weight"), "a point piece includes its views");
    assert_eq!(Piece::Stem { branch: Branch::OneToOne, level: 2, kind: StemKind::Point }.name(), "stem.one2one_cv4.2");
}

/// A runner that breaks the contract: hands bodies no inputs, or adds an output to point stems.
enum Broken {
    NoInputs,
    ExtraPointOutput,
}

impl PieceRunner for Broken {
    fn run(&self, piece: Piece, inputs: &[Tensor], body: &PieceBody<'_>) -> Result<Vec<Tensor>> {
        match self {
            Broken::NoInputs => body(&[]),
            Broken::ExtraPointOutput => {
                let mut out = body(inputs)?;
                if matches!(piece, Piece::Stem { kind: StemKind::Point, .. }) {
                    out.push(out[0].clone());
                }
                Ok(out)
            }
        }
    }
}

#[test]
fn a_runner_breaking_the_contract_gets_a_typed_error_naming_the_piece() {
    let m = model();
    let Err(err) = m.forward_with(&image(), &Broken::NoInputs) else { panic!("no inputs must be an error") };
    assert!(err.to_string().contains("piece trunk was given 0 inputs, expected 1"), "{err}");
    let Err(err) = m.forward_with(&image(), &Broken::ExtraPointOutput) else { panic!("an extra output must be an error") };
    assert!(err.to_string().contains("piece stem.cv4.0 returned 3 outputs, expected 2"), "{err}");
}

#[test]
fn a_replaced_head_gets_fresh_surfaces_and_the_trunk_keeps_its_own() {
    let mut m = model();
    let point = Piece::Stem { branch: Branch::OneToMany, level: 0, kind: StemKind::Point };
    let kpt_rows = |m: &PoseModel| {
        let s = m.piece_surface(point);
        s.iter().find(|(n, _, _)| n == "model.23.cv4_kpts.0.weight").map(|(_, t, _)| t.dims()[0])
    };
    let trunk = m.piece_surface(Piece::Trunk);
    assert_eq!(kpt_rows(&m), Some(17 * 3));
    m.rehead(1, (5, 3), 9).expect("rehead");
    assert_eq!(kpt_rows(&m), Some(5 * 3), "the point stem's surface is the new head's");
    let again = m.piece_surface(Piece::Trunk);
    assert!(trunk.iter().zip(again.iter()).all(|(a, b)| a.0 == b.0 && a.1.storage_ptr() == b.1.storage_ptr()));
}
