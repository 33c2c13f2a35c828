//! Starting and joining a data-parallel run: `device=0,1` names the GPUs, the launching process
//! starts one worker process per GPU and ends them all when one fails; a worker (or a process
//! started by torchrun or SLURM) finds its place in the environment torchrun sets.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use super::store::StoreServer;
use crate::error::{Result, TrainerError};
use crate::fit::interrupt::{SIGINT, SIGTERM};

/// The variable that gives a worker the rendezvous store's address (set by ptl's launcher; under
/// another launcher rank 0 serves the store itself, see [`WorkerEnv::store_addr`]).
pub const STORE_ADDR_ENV: &str = "PTL_STORE_ADDR";

/// The GPUs of a `device=` setting that names several (`0,1`, `cuda:0,1`, `0, 2`); `None` for a
/// setting that names one device or none (`0`, `cuda:1`, `cpu`, `auto`). A GPU named twice or a
/// part that is not an ordinal is an error naming it.
pub fn device_list(setting: &str) -> Result<Option<Vec<usize>>> {
    let t = setting.trim().to_ascii_lowercase();
    let ordinals = t.strip_prefix("cuda:").unwrap_or(&t);
    if !ordinals.contains(',') {
        return Ok(None);
    }
    let bad = |reason: String| TrainerError::InvalidArgument { what: "device", reason };
    let mut list = Vec::new();
    for part in ordinals.split(',') {
        let n: usize =
            part.trim().parse().map_err(|_| bad(format!("`{setting}`: `{}` is not a GPU number (write device=0,1)", part.trim())))?;
        if list.contains(&n) {
            return Err(bad(format!("`{setting}` names GPU {n} twice")));
        }
        list.push(n);
    }
    Ok(Some(list))
}

/// Where a worker stands in its group, from the variables torchrun (and ptl's launcher) set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEnv {
    /// `RANK`: this process's rank in the group.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of ranks.
    pub world: usize,
    /// `LOCAL_RANK`: this process's rank on its host (which of the host's GPUs it takes).
    pub local_rank: usize,
    /// `MASTER_ADDR:MASTER_PORT`: rank 0's host and the launcher's port.
    pub master: String,
    /// `PTL_STORE_ADDR`, when ptl's launcher serves the store.
    pub store: Option<String>,
    /// Whether torchrun started this process (`TORCHELASTIC_RUN_ID`): its agent holds
    /// `MASTER_PORT` already.
    pub under_torchrun: bool,
}

impl WorkerEnv {
    /// The worker's place from `var` (an environment reader): `None` when `RANK` and
    /// `WORLD_SIZE` are both unset (a plain run); an error naming the variable when one is
    /// missing or not a number, or the rank is outside the world.
    pub fn from_env(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<WorkerEnv>> {
        let (rank, world) = (var("RANK"), var("WORLD_SIZE"));
        if rank.is_none() && world.is_none() {
            return Ok(None);
        }
        let bad = |reason: String| TrainerError::InvalidArgument { what: "launcher environment", reason };
        let number = |name: &str| -> Result<usize> {
            let v = var(name).ok_or_else(|| bad(format!("{name} is not set (RANK and WORLD_SIZE are: a launcher sets all of them)")))?;
            v.trim().parse().map_err(|_| bad(format!("{name}={v} is not a number")))
        };
        let (rank, world) = (number("RANK")?, number("WORLD_SIZE")?);
        let local_rank = match var("LOCAL_RANK") {
            Some(_) => number("LOCAL_RANK")?,
            None => rank,
        };
        if world == 0 || rank >= world {
            return Err(bad(format!("RANK={rank} is not a rank of WORLD_SIZE={world}")));
        }
        let addr = var("MASTER_ADDR").ok_or_else(|| bad("MASTER_ADDR is not set (rank 0's host)".into()))?;
        let port = number("MASTER_PORT")?;
        Ok(Some(WorkerEnv {
            rank,
            world,
            local_rank,
            master: format!("{addr}:{port}"),
            store: var(STORE_ADDR_ENV),
            under_torchrun: var("TORCHELASTIC_RUN_ID").is_some(),
        }))
    }

    /// The rendezvous store's address, and whether this process must serve it: ptl's launcher's
    /// (`PTL_STORE_ADDR`); else `MASTER_ADDR:MASTER_PORT` served by rank 0 — one port higher
    /// under torchrun, whose agent serves its own store on `MASTER_PORT`.
    pub fn store_addr(&self) -> Result<(String, bool)> {
        if let Some(s) = &self.store {
            return Ok((s.clone(), false));
        }
        let addr: SocketAddr = match self.master.parse() {
            Ok(a) => a,
            Err(_) => {
                // A host name: resolve it once.
                use std::net::ToSocketAddrs;
                self.master.to_socket_addrs().ok().and_then(|mut a| a.next()).ok_or_else(|| TrainerError::InvalidArgument {
                    what: "launcher environment",
                    reason: format!("MASTER_ADDR:MASTER_PORT = {} does not resolve to an address", self.master),
                })?
            }
        };
        let port = addr.port().checked_add(u16::from(self.under_torchrun)).ok_or_else(|| TrainerError::InvalidArgument {
            what: "launcher environment",
            reason: format!("MASTER_PORT {} leaves no port above it for ptl's store under torchrun", addr.port()),
        })?;
        Ok((SocketAddr::new(addr.ip(), port).to_string(), self.rank == 0))
    }
}

/// Starts one worker per GPU of `devices` — `program` with `args`, and the environment torchrun
/// would give it (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), the address
/// of a rendezvous store this process serves on loopback, and `NCCL_NVLS_ENABLE=0` unless the user
/// set it (NVLink multicast stays off) — then waits for them (see [`supervise`]).
pub fn launch_local(program: &Path, args: &[std::ffi::OsString], devices: &[usize]) -> Result<()> {
    let store = StoreServer::serve("127.0.0.1:0")?;
    let addr = store.addr();
    let mut children = Vec::with_capacity(devices.len());
    for rank in 0..devices.len() {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", devices.len().to_string())
            .env("MASTER_ADDR", addr.ip().to_string())
            .env("MASTER_PORT", addr.port().to_string())
            .env(STORE_ADDR_ENV, addr.to_string());
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                end_all(&mut children);
                return Err(TrainerError::Io { path: program.to_path_buf(), source: e });
            }
        }
    }
    supervise(children, Duration::from_millis(100), STOP_GRACE)
}

/// How long the launcher waits for the other workers once one stopped for a signal (they stop
/// at their group's next agreement, rank 0 after writing its checkpoint).
pub const STOP_GRACE: Duration = Duration::from_secs(300);

/// Waits for every worker (rank = position): all exit 0 → `Ok`. A worker that exits with a
/// failure ends the others at once (a rank whose peer died would wait in its collective until
/// the watchdog's timeout) and is the error, naming its rank and exit status. A worker that
/// stopped for a signal (exit status 128 + SIGINT or SIGTERM: the group agreed to stop, and
/// rank 0 keeps the place in its checkpoint) is waited for with the others, up to `grace`
/// (then the rest are ended), and the result is [`TrainerError::Interrupted`].
pub fn supervise(mut children: Vec<Child>, poll: Duration, grace: Duration) -> Result<()> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut stopping: Option<(i32, std::time::Instant)> = None;
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank].is_some() {
                continue;
            }
            let status =
                child.try_wait().map_err(|e| TrainerError::Collective { rank, reason: format!("cannot wait for the worker: {e}") })?;
            let Some(status) = status else { continue };
            done[rank] = Some(status);
            match status.code() {
                Some(0) => {}
                Some(code) if code == 128 + SIGINT || code == 128 + SIGTERM => {
                    stopping.get_or_insert((code - 128, std::time::Instant::now() + grace));
                }
                _ => {
                    end_all(&mut children);
                    return Err(TrainerError::WorkerFailed { rank, status: status.to_string() });
                }
            }
        }
        if done.iter().all(Option::is_some) {
            return match stopping {
                Some((signal, _)) => Err(TrainerError::Interrupted { signal, checkpoint: None }),
                None => Ok(()),
            };
        }
        if let Some((signal, _)) = stopping.filter(|(_, d)| std::time::Instant::now() > *d) {
            let late = done.iter().position(Option::is_none).unwrap_or(0);
            end_all(&mut children);
            return Err(TrainerError::WorkerFailed {
                rank: late,
                status: format!(
                    "no exit within {:.0} s of the group's stop for {}",
                    grace.as_secs_f64(),
                    crate::fit::interrupt::signal_name(signal)
                ),
            });
        }
        std::thread::sleep(poll);
    }
}

/// Kills every worker still running and reaps them.
fn end_all(children: &mut [Child]) {
    for child in children.iter_mut() {
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Instant;

    #[test]
    fn device_lists_name_several_gpus_once_each() {
        assert_eq!(device_list("0,1").unwrap(), Some(vec![0, 1]));
        assert_eq!(device_list("cuda:2, 3").unwrap(), Some(vec![2, 3]));
        assert_eq!(device_list("0").unwrap(), None);
        assert_eq!(device_list("auto").unwrap(), None);
        assert!(device_list("0,0").unwrap_err().to_string().contains("GPU 0 twice"));
        assert!(device_list("0,x").unwrap_err().to_string().contains("`x` is not a GPU number"));
    }

    #[test]
    fn the_worker_environment_is_read_and_checked() {
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            move |k: &str| m.get(k).cloned()
        };
        assert_eq!(WorkerEnv::from_env(&env(&[])).unwrap(), None, "a plain run");
        let full = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        let w = WorkerEnv::from_env(&env(&full)).unwrap().unwrap();
        assert_eq!((w.rank, w.world, w.local_rank, w.master.as_str()), (1, 2, 1, "127.0.0.1:29500"));
        assert_eq!(w.store_addr().unwrap(), ("127.0.0.1:29500".to_string(), false), "rank 1 connects to rank 0's store");
        let torchrun = [&full[..], &[("TORCHELASTIC_RUN_ID", "x"), ("RANK", "0")]].concat();
        let w0 = WorkerEnv::from_env(&env(&torchrun)).unwrap().unwrap();
        assert_eq!(w0.store_addr().unwrap(), ("127.0.0.1:29501".to_string(), true), "torchrun's agent holds MASTER_PORT");
        let launched = [&full[..], &[(STORE_ADDR_ENV, "127.0.0.1:4000")]].concat();
        assert_eq!(WorkerEnv::from_env(&env(&launched)).unwrap().unwrap().store_addr().unwrap(), ("127.0.0.1:4000".to_string(), false));
        let e = WorkerEnv::from_env(&env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err().to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = WorkerEnv::from_env(&env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err().to_string();
        assert!(e.contains("RANK=2 is not a rank of WORLD_SIZE=2"), "{e}");
    }

    fn sh(script: &str) -> Child {
        Command::new("sh").arg("-c").arg(script).spawn().unwrap()
    }

    /// A worker that fails ends the others at once (a sleeping one is killed, not waited for) and
    /// the error names its rank and status; workers that all succeed are `Ok`.
    #[test]
    fn a_failing_worker_ends_the_others() {
        let t = Instant::now();
        let e = supervise(vec![sh("sleep 30"), sh("exit 3"), sh("sleep 30")], Duration::from_millis(20), STOP_GRACE).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10), "the sleeping workers were ended, not waited for");
        match e {
            TrainerError::WorkerFailed { rank, status } => assert_eq!((rank, status.contains('3')), (1, true), "{status}"),
            other => panic!("{other}"),
        }
        supervise(vec![sh("exit 0"), sh("sleep 0.1")], Duration::from_millis(20), STOP_GRACE).unwrap();
    }

    /// Workers that stop for a signal (exit 143: SIGTERM) are waited for — the slower one is not
    /// killed — and the result is an interruption; one that does not stop within the grace time
    /// is ended and named.
    #[test]
    fn a_group_stopping_for_a_signal_is_waited_for() {
        let (poll, grace) = (Duration::from_millis(20), Duration::from_secs(20));
        let e = supervise(vec![sh("exit 143"), sh("sleep 0.5; exit 143")], poll, grace).unwrap_err();
        assert!(matches!(e, TrainerError::Interrupted { signal: SIGTERM, checkpoint: None }), "{e}");
        let t = Instant::now();
        let e = supervise(vec![sh("exit 130"), sh("sleep 30")], poll, Duration::from_millis(200)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(10));
        match e {
            TrainerError::WorkerFailed { rank, status } => assert!(rank == 1 && status.contains("SIGINT"), "{rank} {status}"),
            other => panic!("{other}"),
        }
    }

    /// The launcher gives each worker torchrun's variables, its rank and the store's address,
    /// and NVLink multicast off.
    #[test]
    fn workers_get_their_place_in_the_environment() {
        let dir = std::env::temp_dir().join(format!("ptl-launch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "echo $RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR ${{{STORE_ADDR_ENV}#*:}} $MASTER_PORT $NCCL_NVLS_ENABLE > {}/rank$RANK",
            dir.display()
        );
        launch_local(Path::new("sh"), &["-c".into(), script.into()], &[3, 5]).unwrap();
        for rank in 0..2 {
            let line = std::fs::read_to_string(dir.join(format!("rank{rank}"))).unwrap();
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(&f[..4], &[rank.to_string().as_str(), rank.to_string().as_str(), "2", "127.0.0.1"], "{line}");
            assert_eq!(f[4], f[5], "the store is at MASTER_PORT: {line}");
            if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
                assert_eq!(f[6], "0", "{line}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
