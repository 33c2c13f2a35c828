//! The rendezvous store: a small key-value server over TCP through which the ranks exchange what
//! they must agree on before the first collective (the NCCL unique id). The launcher serves it on
//! loopback for one host; under an outside launcher (torchrun, SLURM) rank 0 serves it at
//! MASTER_ADDR:MASTER_PORT, so one mechanism covers one host and several. A `get` waits until the
//! key is set, up to a timeout.
//!
//! Wire format, one request per connection: `SET <key> <n>\n` then n bytes, answered `OK\n`;
//! `GET <key>\n`, answered `VAL <n>\n` then n bytes once the key exists. Keys are one word of at
//! most 128 bytes; values at most [`MAX_VALUE`] bytes.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Result, TrainerError};

/// The largest value the store keeps (an NCCL unique id is 128 bytes).
pub const MAX_VALUE: usize = 1 << 16;

fn err(reason: String) -> TrainerError {
    TrainerError::InvalidArgument { what: "rendezvous store", reason }
}

/// The values set so far, and a signal for the requests waiting on them.
type Values = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// A running store; it serves until the process ends.
pub struct StoreServer {
    addr: SocketAddr,
}

impl StoreServer {
    /// Serves on `addr` (port 0: any free port) from a background thread.
    pub fn serve(addr: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| err(format!("cannot listen on {addr}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| err(format!("{addr}: {e}")))?;
        let values: Values = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let values = values.clone();
                std::thread::spawn(move || {
                    if let Err(e) = answer(conn, &values) {
                        log::warn!("ptl: rendezvous store: {e}");
                    }
                });
            }
        });
        Ok(StoreServer { addr })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn checked_key(key: &str) -> Result<&str> {
    if key.is_empty() || key.len() > 128 || key.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
        return Err(err(format!("key {key:?}: one word of 1 to 128 bytes")));
    }
    Ok(key)
}

fn answer(conn: TcpStream, values: &Values) -> Result<()> {
    let mut reader = BufReader::new(conn.try_clone().map_err(|e| err(e.to_string()))?);
    let mut line = String::new();
    reader.by_ref().take(256).read_line(&mut line).map_err(|e| err(e.to_string()))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut out = conn;
    match words.as_slice() {
        ["SET", key, n] => {
            let key = checked_key(key)?;
            let n: usize = n.parse().ok().filter(|&n| n <= MAX_VALUE).ok_or_else(|| err(format!("SET {key}: bad length {n}")))?;
            let mut value = vec![0u8; n];
            reader.read_exact(&mut value).map_err(|e| err(format!("SET {key}: {e}")))?;
            let (lock, signal) = &**values;
            lock.lock().map_err(|_| err("poisoned".into()))?.insert(key.to_string(), value);
            signal.notify_all();
            out.write_all(b"OK\n").map_err(|e| err(e.to_string()))
        }
        ["GET", key] => {
            let key = checked_key(key)?;
            let (lock, signal) = &**values;
            let mut map = lock.lock().map_err(|_| err("poisoned".into()))?;
            // The client gives up after its timeout and closes; a request for a key never set
            // waits here until the process ends (each request is its own thread).
            while !map.contains_key(key) {
                map = signal.wait(map).map_err(|_| err("poisoned".into()))?;
            }
            let value = map[key].clone();
            drop(map);
            out.write_all(format!("VAL {}\n", value.len()).as_bytes()).and_then(|_| out.write_all(&value)).map_err(|e| err(e.to_string()))
        }
        _ => Err(err(format!("unknown request {:?}", line.trim()))),
    }
}

/// Sets `key` to `value` in the store at `addr`, connecting for up to `timeout` (the server may
/// still be starting).
pub fn store_set(addr: &str, key: &str, value: &[u8], timeout: Duration) -> Result<()> {
    checked_key(key)?;
    if value.len() > MAX_VALUE {
        return Err(err(format!("SET {key}: {} bytes, at most {MAX_VALUE}", value.len())));
    }
    let mut conn = connect(addr, timeout)?;
    conn.write_all(format!("SET {key} {}\n", value.len()).as_bytes())
        .and_then(|_| conn.write_all(value))
        .map_err(|e| err(e.to_string()))?;
    let mut reply = String::new();
    BufReader::new(conn).read_line(&mut reply).map_err(|e| err(e.to_string()))?;
    if reply.trim() != "OK" {
        return Err(err(format!("SET {key}: the store answered {:?}", reply.trim())));
    }
    Ok(())
}

/// The value of `key` in the store at `addr`, waiting until some rank sets it, up to `timeout`
/// in all; the error names the key and the wait.
pub fn store_get(addr: &str, key: &str, timeout: Duration) -> Result<Vec<u8>> {
    checked_key(key)?;
    let start = Instant::now();
    let mut conn = connect(addr, timeout)?;
    let left = timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
    conn.set_read_timeout(Some(left)).map_err(|e| err(e.to_string()))?;
    conn.write_all(format!("GET {key}\n").as_bytes()).map_err(|e| err(e.to_string()))?;
    let mut reader = BufReader::new(conn);
    let mut head = String::new();
    reader.by_ref().take(64).read_line(&mut head).map_err(|e| {
        err(format!(
            "GET {key}: no rank set it within {:.1} s ({e}); is every rank started with the same MASTER_ADDR/PORT?",
            timeout.as_secs_f64()
        ))
    })?;
    let n: usize = head
        .strip_prefix("VAL ")
        .and_then(|n| n.trim().parse().ok())
        .filter(|&n| n <= MAX_VALUE)
        .ok_or_else(|| err(format!("GET {key}: the store answered {:?}", head.trim())))?;
    let mut value = vec![0u8; n];
    reader.read_exact(&mut value).map_err(|e| err(format!("GET {key}: {e}")))?;
    Ok(value)
}

fn connect(addr: &str, timeout: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(c) => return Ok(c),
            Err(e) if start.elapsed() >= timeout => {
                return Err(err(format!("cannot reach the store at {addr} within {:.1} s: {e}", timeout.as_secs_f64())))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_get_waits_for_the_set_of_another_rank() {
        let server = StoreServer::serve("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let a2 = addr.clone();
        let getter = std::thread::spawn(move || store_get(&a2, "nccl_id", Duration::from_secs(10)).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        let id: Vec<u8> = (0..128).collect();
        store_set(&addr, "nccl_id", &id, Duration::from_secs(5)).unwrap();
        assert_eq!(getter.join().unwrap(), id);
        assert_eq!(store_get(&addr, "nccl_id", Duration::from_secs(1)).unwrap(), id, "a later get finds it at once");
    }

    #[test]
    fn a_key_never_set_times_out_with_its_name_and_bad_keys_are_refused() {
        let server = StoreServer::serve("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let e = store_get(&addr, "missing", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(e.contains("GET missing") && e.contains("MASTER_ADDR"), "{e}");
        assert!(store_set(&addr, "two words", b"x", Duration::from_secs(1)).is_err());
        assert!(store_set(&addr, "big", &vec![0u8; MAX_VALUE + 1], Duration::from_secs(1)).is_err());
    }

    #[test]
    fn no_server_is_an_error_naming_the_address() {
        // A port nothing listens on: bind one, then let it go.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = store_get(&format!("127.0.0.1:{port}"), "k", Duration::from_millis(100)).unwrap_err().to_string();
        assert!(e.contains("cannot reach the store"), "{e}");
    }
}
