//! Conflict resolution of the task-aligned assigner (docs/loss.md §2.5): an anchor claimed by several
//! GTs goes to the GT of largest overlap, and on equal overlaps to the *first* of them (torch's
//! `argmax` returns the first maximum).

use ptl_trainer::loss::assigner::NOT_LOADED;
use ptl_trainer::loss::targets::PaddedTargets;
use ptl_trainer::loss::{assign, candidate_sets, Anchors, AssignInputs, AssignParams, Assignment};

const STRIDE: f64 = 8.0;
/// One level of 8 × 8 anchors (a 64-px image, stride 8), centres at 4, 12, …, 60 px.
const GRID: usize = 8;
/// Where every anchor predicts the single keypoint (pixels).
const PRED_KPT: [f32; 2] = [30.0, 24.0];

/// Assigns one image with two GTs of one keypoint each (`boxes` xyxy px, keypoints `kpts` (x, y)
/// visible). Every anchor predicts the same score (0.5), box and keypoint, so a GT's overlap is
/// the same at all of its candidates, and two GTs with the same keypoint and box area have equal
/// overlaps wherever both claim an anchor.
fn assign_two(boxes: [[f32; 4]; 2], kpts: [[f32; 2]; 2]) -> Assignment {
    let anchors = Anchors::from_levels(&[(GRID, GRID)], &[STRIDE]).expect("anchors");
    let na = anchors.len();
    let targets = PaddedTargets {
        batch_size: 1,
        max_boxes: 2,
        nkpt: 1,
        labels: vec![0.0, 0.0],
        boxes: boxes.iter().flatten().copied().collect(),
        mask: vec![true, true],
        kpts: kpts.iter().flat_map(|k| [k[0], k[1], 2.0]).collect(),
    };
    // topk 10, no second filter (topk2 = topk), as the one-to-many branch.
    let params = AssignParams::pose(10, 10, &[STRIDE], &[0.1]);
    let cands = candidate_sets(&targets, &anchors.points_px(), &anchors.strides, &params).expect("candidates");
    let rows: Vec<u32> = (0..na as u32).collect();
    assert!(!rows.contains(&NOT_LOADED));
    let scores = vec![0.5f32; na];
    let pred_boxes: Vec<f32> = (0..na).flat_map(|_| [16.0f32, 8.0, 48.0, 40.0]).collect();
    let pred_kpts: Vec<f32> = (0..na).flat_map(|_| PRED_KPT).collect();
    let inp = AssignInputs {
        batch_size: 1,
        num_anchors: na,
        nc: 1,
        rows: &rows,
        scores: &scores,
        boxes: &pred_boxes,
        kpts: &pred_kpts,
        strides: &anchors.strides,
        targets: &targets,
        candidates: &cands,
    };
    assign(&inp, &params).expect("assignment")
}

/// Anchor index of grid cell (column x, row y).
fn cell(x: usize, y: usize) -> usize {
    y * GRID + x
}

/// Two 32 × 32 boxes, the second 16 px to the right: both contain grid columns 3 and 4 of rows
/// 1–4. With equal metrics, top-10 takes the lowest anchor indices of each GT's candidates, so
/// both claim (3, 1), (4, 1), (3, 2), (4, 2).
const LEFT: [f32; 4] = [8.0, 8.0, 40.0, 40.0];
const RIGHT: [f32; 4] = [24.0, 8.0, 56.0, 40.0];
const SHARED: [(usize, usize); 4] = [(3, 1), (4, 1), (3, 2), (4, 2)];

/// Equal overlaps (same keypoint, same box area): every shared anchor goes to GT 0, whichever
/// box comes first.
#[test]
fn equal_overlaps_go_to_the_first_gt() {
    let kpt = [32.0, 24.0];
    for (order, boxes) in [("left first", [LEFT, RIGHT]), ("right first", [RIGHT, LEFT])] {
        let a = assign_two(boxes, [kpt, kpt]);
        assert_eq!(a.n_conflicts, SHARED.len(), "{order}: the four shared anchors are conflicts");
        for (x, y) in SHARED {
            let j = cell(x, y);
            assert!(a.fg_mask[j], "{order}: anchor ({x}, {y}) stays foreground");
            assert_eq!(a.target_gt_idx[j], 0, "{order}: tie at anchor ({x}, {y}) must go to the first GT (torch argmax)");
            assert_eq!(a.target_bboxes[4 * j..4 * j + 4], boxes[0], "{order}: anchor ({x}, {y}) targets the first GT's box");
        }
        // Each GT still owns its unshared positives.
        assert_eq!(a.target_gt_idx[cell(1, 1)], usize::from(boxes[0] != LEFT), "{order}");
        assert_eq!(a.target_gt_idx[cell(5, 1)], usize::from(boxes[0] != RIGHT), "{order}");
    }
}

/// Control: when GT 1's keypoint sits exactly on the predictions its overlap is strictly larger,
/// and the shared anchors go to GT 1 — the resolution follows the overlap, not the order.
#[test]
fn larger_overlap_wins_regardless_of_order() {
    let a = assign_two([LEFT, RIGHT], [[32.0, 24.0], PRED_KPT]);
    assert_eq!(a.n_conflicts, SHARED.len());
    for (x, y) in SHARED {
        let j = cell(x, y);
        assert!(a.fg_mask[j]);
        assert_eq!(a.target_gt_idx[j], 1, "anchor ({x}, {y}) goes to the GT of larger overlap");
    }
}
