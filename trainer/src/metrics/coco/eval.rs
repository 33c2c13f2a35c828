//! A port of pycocotools' `COCOeval` (evaluate → accumulate → summarize) for boxes and keypoints.
//!
//! Kept faithful in the details that move the numbers: detections sorted by score with a stable
//! sort and cut at the largest maxDets before similarity; GTs ignored for crowd, outside the area
//! range, or (keypoints) with `num_keypoints == 0`; greedy matching in score order where an
//! ignored GT is only used when no regular GT matches; crowd GTs can absorb several detections;
//! unmatched detections outside the area range are ignored; 101 recall thresholds with the
//! precision envelope and `searchsorted(side='left')`; summary = mean of entries > −1.

use std::collections::{BTreeSet, HashMap, HashSet};

use super::json::{CocoAnnotation, CocoDataset, CocoResult};
use crate::error::{Result, TrainerError};

/// Most (category, area range, image) cells an evaluation builds (a few GiB of tables).
const MAX_EVAL_CELLS: u64 = 1 << 27;

/// Which similarity COCOeval uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IouType {
    /// Box IoU, 12 summary stats.
    Bbox,
    /// Keypoint OKS, 10 summary stats.
    Keypoints,
}

/// COCOeval parameters (`Params` of pycocotools).
#[derive(Clone, Debug, PartialEq)]
pub struct EvalParams {
    /// Similarity type.
    pub iou_type: IouType,
    /// Images evaluated (sorted GT image ids by default).
    pub img_ids: Vec<i64>,
    /// Categories evaluated (sorted GT category ids by default).
    pub cat_ids: Vec<i64>,
    /// IoU/OKS thresholds, `np.linspace(.5, .95, 10)`.
    pub iou_thrs: Vec<f64>,
    /// Recall thresholds, `np.linspace(0, 1, 101)`.
    pub rec_thrs: Vec<f64>,
    /// Max detections per image (ascending).
    pub max_dets: Vec<usize>,
    /// Area ranges `[lo, hi]`.
    pub area_rng: Vec<[f64; 2]>,
    /// Area range labels.
    pub area_rng_lbl: Vec<&'static str>,
    /// Keypoint sigmas (COCO's 17 by default).
    pub kpt_oks_sigmas: Vec<f64>,
}

/// `np.linspace(start, stop, num)` (endpoint included).
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let step = (stop - start) / (num as f64 - 1.0);
    let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    if let Some(l) = v.last_mut() {
        *l = stop;
    }
    v
}

impl EvalParams {
    /// pycocotools defaults for `iou_type`, with image and category ids taken from `gt`.
    pub fn new(iou_type: IouType, gt: &CocoDataset) -> Self {
        let img_ids: BTreeSet<i64> = gt.images.iter().map(|i| i.id).collect();
        let cat_ids: BTreeSet<i64> = gt.categories.iter().map(|c| c.id).collect();
        let big = 1e5f64.powi(2);
        let (max_dets, area_rng, area_rng_lbl) = match iou_type {
            IouType::Bbox => (
                vec![1, 10, 100],
                vec![[0.0, big], [0.0, 32.0 * 32.0], [32.0 * 32.0, 96.0 * 96.0], [96.0 * 96.0, big]],
                vec!["all", "small", "medium", "large"],
            ),
            IouType::Keypoints => {
                (vec![20], vec![[0.0, big], [32.0 * 32.0, 96.0 * 96.0], [96.0 * 96.0, big]], vec!["all", "medium", "large"])
            }
        };
        EvalParams {
            iou_type,
            img_ids: img_ids.into_iter().collect(),
            cat_ids: cat_ids.into_iter().collect(),
            iou_thrs: linspace(0.5, 0.95, 10),
            rec_thrs: linspace(0.0, 1.0, 101),
            max_dets,
            area_rng,
            area_rng_lbl,
            kpt_oks_sigmas: [0.26, 0.25, 0.25, 0.35, 0.35, 0.79, 0.79, 0.72, 0.72, 0.62, 0.62, 1.07, 1.07, 0.87, 0.87, 0.89, 0.89]
                .iter()
                .map(|s| s / 10.0)
                .collect(),
        }
    }
}

/// Result of [`evaluate`].
#[derive(Clone, Debug, PartialEq)]
pub struct CocoEvalResult {
    /// Parameters used.
    pub params: EvalParams,
    /// Summary stats (12 for bbox, 10 for keypoints), −1 where undefined.
    pub stats: Vec<f64>,
    /// pycocotools' printed summary lines.
    pub summary: Vec<String>,
    /// Precision `[T][R][K][A][M]` flattened, −1 where undefined.
    pub precision: Vec<f64>,
    /// Recall `[T][K][A][M]` flattened, −1 where undefined.
    pub recall: Vec<f64>,
}

/// A detection after `loadRes`: id = position + 1, area from the box (or keypoint extent).
struct Det {
    id: i64,
    score: f64,
    area: f64,
    bbox: [f64; 4],
    keypoints: Vec<f64>,
}

/// `loadRes`: validates image ids and derives id/area/bbox the way pycocotools does
/// (the branch is chosen by the first result: box if it has a non-empty bbox, else keypoints).
fn load_res(gt: &CocoDataset, res: &[CocoResult]) -> Result<Vec<(i64, i64, Det)>> {
    let imgs: HashSet<i64> = gt.images.iter().map(|i| i.id).collect();
    if let Some(r) = res.iter().find(|r| !imgs.contains(&r.image_id)) {
        return Err(TrainerError::Coco(format!("results contain image_id {} that is not in the ground truth", r.image_id)));
    }
    let use_bbox = res.first().is_some_and(|r| !r.bbox.is_empty());
    let mut out = Vec::with_capacity(res.len());
    for (i, r) in res.iter().enumerate() {
        let id = i as i64 + 1;
        if !r.score.is_finite() {
            return Err(TrainerError::NonFinite { what: "result score", index: i, value: r.score });
        }
        let (bbox, area) = if use_bbox {
            let b: [f64; 4] = r
                .bbox
                .as_slice()
                .try_into()
                .map_err(|_| TrainerError::Coco(format!("result {i}: bbox must have 4 values, got {}", r.bbox.len())))?;
            (b, b[2] * b[3])
        } else {
            if r.keypoints.is_empty() || r.keypoints.len() % 3 != 0 {
                return Err(TrainerError::Coco(format!("result {i}: neither a bbox nor 3·K keypoints")));
            }
            let xs = r.keypoints.iter().step_by(3);
            let ys = r.keypoints.iter().skip(1).step_by(3);
            let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
            let (y0, y1) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
            ([x0, y0, x1 - x0, y1 - y0], (x1 - x0) * (y1 - y0))
        };
        out.push((r.image_id, r.category_id, Det { id, score: r.score, area, bbox, keypoints: r.keypoints.clone() }));
    }
    Ok(out)
}

/// Per (image, category) data after `_prepare` and `computeIoU/computeOks`.
struct Cell<'a> {
    gts: Vec<&'a CocoAnnotation>,
    /// GT ignore flag before area ranges (crowd, or no keypoints for OKS).
    gt_ignore: Vec<bool>,
    /// Detections sorted by score (stable), cut at the largest maxDets.
    dts: Vec<&'a Det>,
    /// Similarity `[d][g]`, empty when either side is empty.
    ious: Vec<Vec<f64>>,
}

fn bbox_iou(d: &[f64; 4], g: &[f64; 4], crowd: bool) -> f64 {
    // maskApi.c bbIou
    let (ga, da) = (g[2] * g[3], d[2] * d[3]);
    let w = (d[2] + d[0]).min(g[2] + g[0]) - d[0].max(g[0]);
    if w <= 0.0 {
        return 0.0;
    }
    let h = (d[3] + d[1]).min(g[3] + g[1]) - d[1].max(g[1]);
    if h <= 0.0 {
        return 0.0;
    }
    let i = w * h;
    let u = if crowd { da } else { da + ga - i };
    i / u
}

fn oks(d: &Det, g: &CocoAnnotation, sigmas: &[f64]) -> Result<f64> {
    let k = sigmas.len();
    if g.keypoints.len() != 3 * k || d.keypoints.len() != 3 * k {
        return Err(TrainerError::Coco(format!(
            "keypoint length mismatch: gt {} has {}, detection {} has {}, expected {}",
            g.id,
            g.keypoints.len(),
            d.id,
            d.keypoints.len(),
            3 * k
        )));
    }
    let vis: Vec<bool> = (0..k).map(|j| g.keypoints[3 * j + 2] > 0.0).collect();
    let k1 = vis.iter().filter(|v| **v).count();
    let bb = g.bbox;
    let (x0, x1) = (bb[0] - bb[2], bb[0] + bb[2] * 2.0);
    let (y0, y1) = (bb[1] - bb[3], bb[1] + bb[3] * 2.0);
    let eps = f64::EPSILON; // np.spacing(1)
    let mut sum = 0.0;
    let mut cnt = 0usize;
    for j in 0..k {
        let (xg, yg) = (g.keypoints[3 * j], g.keypoints[3 * j + 1]);
        let (xd, yd) = (d.keypoints[3 * j], d.keypoints[3 * j + 1]);
        let (dx, dy) =
            if k1 > 0 { (xd - xg, yd - yg) } else { (0f64.max(x0 - xd) + 0f64.max(xd - x1), 0f64.max(y0 - yd) + 0f64.max(yd - y1)) };
        if k1 > 0 && !vis[j] {
            continue;
        }
        let var = (sigmas[j] * 2.0).powi(2);
        let e = (dx * dx + dy * dy) / var / (g.area + eps) / 2.0;
        sum += (-e).exp();
        cnt += 1;
    }
    Ok(sum / cnt as f64)
}

/// Per (category, area, image) result of `evaluateImg`.
struct EvalImg {
    dt_scores: Vec<f64>,
    /// `[t][d]` matched GT id (0 = unmatched).
    dt_matches: Vec<Vec<i64>>,
    /// `[t][d]`.
    dt_ignore: Vec<Vec<bool>>,
    gt_ignore: Vec<bool>,
}

fn evaluate_img(cell: &Cell, a_rng: [f64; 2], max_det: usize, thrs: &[f64]) -> Option<EvalImg> {
    if cell.gts.is_empty() && cell.dts.is_empty() {
        return None;
    }
    let outside = |a: f64| a < a_rng[0] || a > a_rng[1];
    let g_ig: Vec<bool> = cell.gts.iter().zip(&cell.gt_ignore).map(|(g, &ig)| ig || outside(g.area)).collect();
    // Stable sort: regular GTs first, ignored last.
    let mut gtind: Vec<usize> = (0..cell.gts.len()).collect();
    gtind.sort_by_key(|&i| g_ig[i]);
    let gts: Vec<&CocoAnnotation> = gtind.iter().map(|&i| cell.gts[i]).collect();
    let gt_ig: Vec<bool> = gtind.iter().map(|&i| g_ig[i]).collect();
    let dts = &cell.dts[..cell.dts.len().min(max_det)];
    let (t_n, g_n, d_n) = (thrs.len(), gts.len(), dts.len());
    let mut gtm = vec![vec![0i64; g_n]; t_n];
    let mut dtm = vec![vec![0i64; d_n]; t_n];
    let mut dt_ig = vec![vec![false; d_n]; t_n];
    if !cell.ious.is_empty() {
        for (ti, &t) in thrs.iter().enumerate() {
            for (di, d) in dts.iter().enumerate() {
                let mut iou = t.min(1.0 - 1e-10);
                let mut m: Option<usize> = None;
                for (gi, g) in gts.iter().enumerate() {
                    if gtm[ti][gi] > 0 && !g.iscrowd {
                        continue;
                    }
                    if let Some(mm) = m {
                        if !gt_ig[mm] && gt_ig[gi] {
                            break;
                        }
                    }
                    let v = cell.ious[di][gtind[gi]];
                    if v < iou {
                        continue;
                    }
                    iou = v;
                    m = Some(gi);
                }
                if let Some(mm) = m {
                    dt_ig[ti][di] = gt_ig[mm];
                    dtm[ti][di] = gts[mm].id;
                    gtm[ti][mm] = d.id;
                }
            }
        }
    }
    for ti in 0..t_n {
        for (di, d) in dts.iter().enumerate() {
            if dtm[ti][di] == 0 && outside(d.area) {
                dt_ig[ti][di] = true;
            }
        }
    }
    Some(EvalImg { dt_scores: dts.iter().map(|d| d.score).collect(), dt_matches: dtm, dt_ignore: dt_ig, gt_ignore: gt_ig })
}

/// Run COCOeval on `gt` and `results` for `iou_type` with pycocotools' default parameters.
pub fn evaluate(gt: &CocoDataset, results: &[CocoResult], iou_type: IouType) -> Result<CocoEvalResult> {
    evaluate_with(gt, results, EvalParams::new(iou_type, gt))
}

/// Run COCOeval with explicit parameters.
pub fn evaluate_with(gt: &CocoDataset, results: &[CocoResult], p: EvalParams) -> Result<CocoEvalResult> {
    if p.max_dets.is_empty() || p.area_rng.is_empty() || p.iou_thrs.is_empty() {
        return Err(TrainerError::InvalidArgument { what: "EvalParams", reason: "maxDets, areaRng and iouThrs must be non-empty".into() });
    }
    let dets = load_res(gt, results)?;
    let img_pos: HashMap<i64, usize> = p.img_ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let cat_pos: HashMap<i64, usize> = p.cat_ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let (ni, nk) = (p.img_ids.len(), p.cat_ids.len());
    // Tables below hold a cell per (category, area range, image): refuse sizes no machine holds.
    let cells = (nk as u64).saturating_mul(ni as u64).saturating_mul(p.area_rng.len().max(1) as u64);
    if cells > MAX_EVAL_CELLS {
        return Err(TrainerError::Coco(format!(
            "{nk} categories × {ni} images is more than the {MAX_EVAL_CELLS} (category, area, image) cells the evaluation can hold"
        )));
    }
    let max_det_last = *p.max_dets.last().unwrap_or(&0);

    // _prepare
    let mut cells: Vec<Cell> =
        (0..ni * nk).map(|_| Cell { gts: Vec::new(), gt_ignore: Vec::new(), dts: Vec::new(), ious: Vec::new() }).collect();
    for g in &gt.annotations {
        if let (Some(&i), Some(&k)) = (img_pos.get(&g.image_id), cat_pos.get(&g.category_id)) {
            let mut ig = g.iscrowd;
            if p.iou_type == IouType::Keypoints {
                ig = g.num_keypoints == Some(0) || ig;
            }
            cells[k * ni + i].gts.push(g);
            cells[k * ni + i].gt_ignore.push(ig);
        }
    }
    for (img, cat, d) in &dets {
        if let (Some(&i), Some(&k)) = (img_pos.get(img), cat_pos.get(cat)) {
            cells[k * ni + i].dts.push(d);
        }
    }
    // computeIoU / computeOks
    for c in &mut cells {
        c.dts.sort_by(|a, b| b.score.total_cmp(&a.score));
        c.dts.truncate(max_det_last);
        if c.gts.is_empty() || c.dts.is_empty() {
            continue;
        }
        c.ious = c
            .dts
            .iter()
            .map(|d| {
                c.gts
                    .iter()
                    .map(|g| match p.iou_type {
                        IouType::Bbox => Ok(bbox_iou(&d.bbox, &g.bbox, g.iscrowd)),
                        IouType::Keypoints => oks(d, g, &p.kpt_oks_sigmas),
                    })
                    .collect::<Result<Vec<f64>>>()
            })
            .collect::<Result<_>>()?;
    }
    // evaluateImg for every (category, area, image)
    let na = p.area_rng.len();
    let eval_imgs: Vec<Option<EvalImg>> = (0..nk)
        .flat_map(|k| (0..na).flat_map(move |a| (0..ni).map(move |i| (k, a, i))))
        .map(|(k, a, i)| evaluate_img(&cells[k * ni + i], p.area_rng[a], max_det_last, &p.iou_thrs))
        .collect();

    // accumulate
    let (t_n, r_n, m_n) = (p.iou_thrs.len(), p.rec_thrs.len(), p.max_dets.len());
    let pidx = |t: usize, r: usize, k: usize, a: usize, m: usize| (((t * r_n + r) * nk + k) * na + a) * m_n + m;
    let ridx = |t: usize, k: usize, a: usize, m: usize| ((t * nk + k) * na + a) * m_n + m;
    let mut precision = vec![-1.0; t_n * r_n * nk * na * m_n];
    let mut recall = vec![-1.0; t_n * nk * na * m_n];
    for k in 0..nk {
        for a in 0..na {
            let es: Vec<&EvalImg> = (0..ni).filter_map(|i| eval_imgs[(k * na + a) * ni + i].as_ref()).collect();
            if es.is_empty() {
                continue;
            }
            for (m, &max_det) in p.max_dets.iter().enumerate() {
                // (score, image slot, detection index) concatenated in image order.
                let mut all: Vec<(f64, usize, usize)> = Vec::new();
                for (ei, e) in es.iter().enumerate() {
                    for (di, &s) in e.dt_scores.iter().take(max_det).enumerate() {
                        all.push((s, ei, di));
                    }
                }
                all.sort_by(|x, y| y.0.total_cmp(&x.0));
                let npig = es.iter().flat_map(|e| &e.gt_ignore).filter(|ig| !**ig).count();
                if npig == 0 {
                    continue;
                }
                for t in 0..t_n {
                    let (mut tp, mut fp) = (0f64, 0f64);
                    let mut rc = Vec::with_capacity(all.len());
                    let mut pr = Vec::with_capacity(all.len());
                    for &(_, ei, di) in &all {
                        let e = es[ei];
                        if e.dt_ignore[t][di] {
                            // neither TP nor FP
                        } else if e.dt_matches[t][di] != 0 {
                            tp += 1.0;
                        } else {
                            fp += 1.0;
                        }
                        rc.push(tp / npig as f64);
                        pr.push(tp / (fp + tp + f64::EPSILON));
                    }
                    let nd = rc.len();
                    recall[ridx(t, k, a, m)] = if nd > 0 { rc[nd - 1] } else { 0.0 };
                    for i in (1..nd).rev() {
                        if pr[i] > pr[i - 1] {
                            pr[i - 1] = pr[i];
                        }
                    }
                    for (ri, &r) in p.rec_thrs.iter().enumerate() {
                        // searchsorted(rc, r, side='left')
                        let pi = rc.partition_point(|&v| v < r);
                        precision[pidx(t, ri, k, a, m)] = if pi < nd { pr[pi] } else { 0.0 };
                    }
                }
            }
        }
    }

    // summarize
    let mut stats = Vec::new();
    let mut summary = Vec::new();
    let mut summ = |ap: bool, iou_thr: Option<f64>, area: &str, max_dets: usize| {
        let a_ind: Vec<usize> = (0..na).filter(|&a| p.area_rng_lbl.get(a) == Some(&area)).collect();
        let m_ind: Vec<usize> = (0..m_n).filter(|&m| p.max_dets[m] == max_dets).collect();
        let t_ind: Vec<usize> = (0..t_n).filter(|&t| iou_thr.is_none_or(|v| v == p.iou_thrs[t])).collect();
        let mut vals = Vec::new();
        for &t in &t_ind {
            for k in 0..nk {
                for &a in &a_ind {
                    for &m in &m_ind {
                        if ap {
                            vals.extend((0..r_n).map(|r| precision[pidx(t, r, k, a, m)]));
                        } else {
                            vals.push(recall[ridx(t, k, a, m)]);
                        }
                    }
                }
            }
        }
        let valid: Vec<f64> = vals.into_iter().filter(|v| *v > -1.0).collect();
        let mean = if valid.is_empty() { -1.0 } else { valid.iter().sum::<f64>() / valid.len() as f64 };
        let iou_str = match iou_thr {
            Some(v) => format!("{v:0.2}"),
            None => format!("{:0.2}:{:0.2}", p.iou_thrs[0], p.iou_thrs[t_n - 1]),
        };
        let (title, ty) = if ap { ("Average Precision", "(AP)") } else { ("Average Recall", "(AR)") };
        summary.push(format!(" {title:<18} {ty} @[ IoU={iou_str:<9} | area={area:>6} | maxDets={max_dets:>3} ] = {mean:0.3}"));
        stats.push(mean);
    };
    let md = &p.max_dets;
    match p.iou_type {
        IouType::Bbox => {
            let (m0, m1, m2) = (md[0], md[1.min(md.len() - 1)], md[2.min(md.len() - 1)]);
            summ(true, None, "all", 100);
            summ(true, Some(0.5), "all", m2);
            summ(true, Some(0.75), "all", m2);
            summ(true, None, "small", m2);
            summ(true, None, "medium", m2);
            summ(true, None, "large", m2);
            summ(false, None, "all", m0);
            summ(false, None, "all", m1);
            summ(false, None, "all", m2);
            summ(false, None, "small", m2);
            summ(false, None, "medium", m2);
            summ(false, None, "large", m2);
        }
        IouType::Keypoints => {
            summ(true, None, "all", 20);
            summ(true, Some(0.5), "all", 20);
            summ(true, Some(0.75), "all", 20);
            summ(true, None, "medium", 20);
            summ(true, None, "large", 20);
            summ(false, None, "all", 20);
            summ(false, Some(0.5), "all", 20);
            summ(false, Some(0.75), "all", 20);
            summ(false, None, "medium", 20);
            summ(false, None, "large", 20);
        }
    }
    Ok(CocoEvalResult { params: p, stats, summary, precision, recall })
}
