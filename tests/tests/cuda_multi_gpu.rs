//! Data-parallel training on two GPUs through the command line (`ptl train device=0,1`): the
//! multi-GPU acceptance that one GPU cannot show. Two runs give the same bytes; `replay=all`
//! gives the native run's bytes at that world size, every recorded region replaying after its
//! warm-up; a worker killed mid-run ends the run at once with its rank named, and `resume=` then
//! finishes with the uninterrupted run's bytes. With fewer than two GPUs it prints `skipping: …`
//! and passes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{ptl, ptl_bin, summary, synth, text, train, Running};

/// Two GPUs, or `None` after saying why not.
fn two_gpus() -> Option<()> {
    ptl_autograd::cuda::device_for_tests(0).expect("a GPU that is present must be usable")?;
    let n = ptl_autograd::cuda::device_count();
    if n < 2 {
        println!("skipping: data-parallel training needs two GPUs, this machine has {n}");
        return None;
    }
    Some(())
}

/// The run's arguments into `dir/<name>` on GPUs 0 and 1: the global batch 4 (2 per GPU).
fn run_args(data: &Path, dir: &Path, name: &str, epochs: usize) -> Vec<String> {
    [
        format!("data={}", data.display()),
        format!("epochs={epochs}"),
        "batch=4".into(),
        "imgsz=64".into(),
        "optimizer=SGD".into(),
        "close_mosaic=0".into(),
        "plots=false".into(),
        "seed=3".into(),
        "device=0,1".into(),
        format!("project={}", dir.display()),
        format!("name={name}"),
    ]
    .to_vec()
}

#[test]
fn cuda_two_gpus_give_the_same_bytes_twice_and_replayed() {
    let Some(()) = two_gpus() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    let hashes = |name: &str| summary(&dir.path().join(name))["hashes"].clone();
    for (name, extra) in
        [("a", &["loss_assigner=dense"][..]), ("b", &["loss_assigner=dense"]), ("replayed", &["loss_assigner=dense", "replay=all"])]
    {
        let o = train(&run_args(&data, dir.path(), name, 2), extra, dir.path());
        assert!(o.status.success(), "{name}: {}", text(&o));
    }
    assert_eq!(hashes("a"), hashes("b"), "two runs on two GPUs");
    assert_eq!(hashes("replayed"), hashes("a"), "replay=all on two GPUs against native");
    let replayed: ptl_trainer::fit::RunSummary = serde_json::from_value(summary(&dir.path().join("replayed"))).expect("rank 0's summary");
    // Every region replayed after its warm-up on rank 0: 10 images over two ranks in batches of 2
    // per GPU are 3 steps an epoch (the last of one image: its own shape), 6 in the two epochs.
    let cache_full = [ptl_capture::FallbackReason::CacheFull];
    for (plugin, calls) in [("step", 6), ("optimizer", replayed.optimizer_steps)] {
        let short = ptl_plugins::replay_shortfalls(&replayed, plugin, calls, &cache_full);
        assert!(short.is_empty(), "{plugin}: {short:?}");
    }
    println!("ok two GPUs: model {} in both runs and replayed", hashes("a")["model"]);
}

/// The processes whose parent is `parent` (Linux's /proc), with their environment.
fn children(parent: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // `pid (comm) state ppid …`: the name may hold spaces or parentheses.
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        if after.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            let env = std::fs::read(e.path().join("environ")).map(|b| String::from_utf8_lossy(&b).replace('\0', "\n")).unwrap_or_default();
            out.push((pid, env));
        }
    }
    out
}

/// Whether process `pid` exists and has not exited (a zombie has).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rsplit_once(')').map(|(_, r)| r.trim_start().chars().next()).unwrap_or(None);
    !matches!(state, Some('Z') | Some('X') | None)
}

#[test]
fn cuda_a_killed_worker_ends_the_run_and_resume_finishes_it() {
    let Some(()) = two_gpus() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = synth(dir.path());
    const EPOCHS: usize = 6;
    let o = train(&run_args(&data, dir.path(), "whole", EPOCHS), &[], dir.path());
    assert!(o.status.success(), "{}", text(&o));
    let reference = summary(&dir.path().join("whole"))["hashes"].clone();

    // The same run, rank 1's worker killed once rank 0 has written a checkpoint.
    let log: PathBuf = dir.path().join("killed.log");
    let out = std::fs::File::create(&log).unwrap();
    let mut args = vec!["train".to_string()];
    args.extend(run_args(&data, dir.path(), "killed", EPOCHS));
    let child = Command::new(ptl_bin())
        .args(&args)
        .current_dir(dir.path())
        .env("PTL_CACHE", dir.path().join("cache"))
        .stdin(Stdio::null())
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .expect("start ptl");
    let began = Instant::now();
    let mut launcher = Running(Some(child));
    let pid = launcher.0.as_ref().unwrap().id();
    let last = dir.path().join("killed/weights/last.ckpt");
    let start = Instant::now();
    while !last.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(240),
            "no checkpoint after 240 s: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        assert!(launcher.0.as_mut().unwrap().try_wait().unwrap().is_none(), "the run ended before its first checkpoint");
        std::thread::sleep(Duration::from_millis(50));
    }
    let workers = children(pid);
    let rank1 = workers.iter().find(|(_, env)| env.lines().any(|l| l == "RANK=1")).map(|(p, _)| *p);
    let rank1 = rank1.unwrap_or_else(|| panic!("no worker with RANK=1 among the launcher's {} children", workers.len()));
    let killed = Command::new("kill").args(["-KILL", &rank1.to_string()]).status().expect("kill");
    assert!(killed.success());
    let killed_after = began.elapsed().as_secs_f64();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = launcher.0.as_mut().unwrap().try_wait().unwrap() {
            launcher.0 = None;
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the launcher still runs 60 s after rank 1 was killed");
        std::thread::sleep(Duration::from_millis(50));
    };
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "a killed worker must fail the run: {said}");
    assert!(said.contains("rank 1"), "the error names the killed rank: {said}");
    // The other worker was ended too (reparented when the launcher exited, so looked up by pid).
    let others: Vec<u32> = workers.iter().map(|(p, _)| *p).filter(|p| *p != rank1).collect();
    let start = Instant::now();
    while others.iter().any(|p| alive(*p)) {
        assert!(start.elapsed() < Duration::from_secs(10), "a worker outlived the launcher: {others:?}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Resumed from rank 0's checkpoint on both GPUs: the uninterrupted run's bytes.
    let o = ptl(&["train", &format!("resume={}", last.display()), "device=0,1"], dir.path());
    assert!(o.status.success(), "resume: {}", text(&o));
    assert_eq!(summary(&dir.path().join("killed"))["hashes"], reference, "killed, resumed: the uninterrupted run's bytes");
    println!("ok two GPUs: rank 1 killed {killed_after:.1} s into the run, which ended naming it; resume gave the uninterrupted bytes");
}
