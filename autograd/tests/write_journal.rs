//! The write journal: the first write to a storage that existed when the journal opened is
//! preceded by a copy, and `restore` puts the bytes back in place; storages created inside are
//! not copied; journals nest; an unwinding body closes its journal.

use ptl_autograd::internal::write_journal::journal_writes;
use ptl_autograd::{Device, Tensor};

fn t(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), Device::Cpu).unwrap()
}

#[test]
fn restores_what_existed_and_skips_what_was_created() {
    let (p, m) = (t(&[1.0, -2.0, 3.0]), t(&[0.0, 0.5, 0.0]));
    let (p_addr, before) = (p.storage_ptr(), (p.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap()));
    let (fresh, journal) = journal_writes(|| {
        m.copy_(&m.mul_scalar(0.9).unwrap().add(&t(&[1.0, 1.0, 1.0])).unwrap()).unwrap();
        p.add_(&m.mul_scalar(-0.1).unwrap()).unwrap();
        p.add_(&m).unwrap(); // a second write to p: still one copy
        let fresh = t(&[7.0, 7.0, 7.0]);
        fresh.add_(&m).unwrap();
        fresh
    })
    .unwrap();
    assert_eq!(journal.len(), 2, "p and m were written; the tensor made inside is not copied");
    assert_eq!(journal.bytes(), 2 * 3 * 4);
    assert_ne!(p.to_vec::<f32>().unwrap(), before.0, "the body moved p");
    journal.restore().unwrap();
    assert_eq!((p.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap()), before, "bytes back as found");
    assert_eq!(p.storage_ptr(), p_addr, "restored in place");
    let m1 = 0.9f32 * 0.5 + 1.0;
    assert_eq!(fresh.to_vec::<f32>().unwrap(), vec![8.0, 7.0 + m1, 8.0], "a tensor made inside keeps its writes");
}

#[test]
fn nested_journals_restore_their_own_writes() {
    let (a, b) = (t(&[1.0]), t(&[2.0]));
    let ((), outer) = journal_writes(|| {
        a.add_(&t(&[1.0])).unwrap();
        let ((), inner) = journal_writes(|| b.add_(&t(&[10.0])).unwrap()).unwrap();
        assert_eq!(inner.len(), 1);
        inner.restore().unwrap();
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![2.0], "the inner journal put b back");
        b.add_(&t(&[5.0])).unwrap();
    })
    .unwrap();
    assert_eq!(outer.len(), 2, "a, and b (first written inside the inner journal)");
    outer.restore().unwrap();
    assert_eq!((a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap()), (vec![1.0], vec![2.0]));
}

#[test]
fn an_unwinding_body_closes_its_journal() {
    let a = t(&[1.0]);
    let r = std::panic::catch_unwind(|| {
        let _ = journal_writes(|| -> () { panic!("body fails") });
    });
    assert!(r.is_err());
    // No journal is left open: a later journal sees only its own writes.
    let ((), j) = journal_writes(|| ()).unwrap();
    assert!(j.is_empty());
    a.add_(&t(&[1.0])).unwrap();
    let ((), j) = journal_writes(|| a.add_(&t(&[1.0])).unwrap()).unwrap();
    assert_eq!(j.len(), 1);
}
