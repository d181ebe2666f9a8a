//! Transport benchmark: `cargo bench -p ibex-transport` (add `-- --quick` for a short run).
//!
//! Everything is measured in one run, side by side, with the peer in a separate process
//! (this binary re-executed with `--ibex-peer`): Ibex shm and tcp against raw TCP loopback,
//! single-thread memcpy and a bare `process_vm_readv` of the same sizes. Only the ratios
//! mean anything on a shared machine; the table prints them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ibex_transport::{Config, Connection, connect, listen};

const MARK_DATA: u8 = 0;
const MARK_LAST: u8 = 1;
const MARK_ECHO: u8 = 2;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--ibex-peer") {
        peer(&args[i + 1], &args[i + 2]);
        return;
    }
    let quick = args.iter().any(|a| a == "--quick") || std::env::var("IBEX_BENCH_QUICK").is_ok();
    let json = args.iter().any(|a| a == "--json");
    let reps = if quick { 3 } else { 7 };
    let lat_iters = if quick { 2_000 } else { 20_000 };

    let mut rows: Vec<Row> = Vec::new();
    let sizes = [64 << 10, 1 << 20, 16 << 20];

    // References.
    for &s in &sizes {
        rows.push(Row::bw("memcpy", s, median(reps, || memcpy_bw(s))));
    }
    rows.push(Row::bw(
        "process_vm_readv (bare)",
        16 << 20,
        median(reps, || cma_bw(16 << 20)),
    ));
    rows.push(Row::lat(
        "raw tcp (blocking)",
        64,
        raw_tcp_latency(lat_iters),
    ));
    for &s in &sizes {
        rows.push(Row::bw("raw tcp", s, median(reps, || raw_tcp_bw(s))));
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for provider in ["shm", "tcp"] {
        let (conn, mut child) = rt.block_on(ibex_pair(provider));
        rows.push(Row::lat(
            &format!("ibex {provider}"),
            64,
            rt.block_on(ibex_latency(&conn, lat_iters)),
        ));
        for &s in &sizes {
            let v = median(reps, || rt.block_on(ibex_bw(&conn, s, false)));
            rows.push(Row::bw(&format!("ibex {provider}"), s, v));
        }
        if provider == "shm" {
            let v = median(reps, || rt.block_on(ibex_bw(&conn, 16 << 20, true)));
            rows.push(Row::bw("ibex shm (registered pool)", 16 << 20, v));
            let st = conn.stats();
            eprintln!("shm sender stats:\n{st}\n");
        }
        rt.block_on(conn.close());
        let _ = child.kill();
        let _ = child.wait();
    }
    report(&rows, json);
}

// ---- measurements ---------------------------------------------------------------------

#[derive(Clone)]
struct Row {
    name: String,
    size: usize,
    /// GB/s for bandwidth rows.
    gbps: Option<f64>,
    /// One-way latency p50 / p99 in µs for latency rows.
    lat: Option<(f64, f64)>,
}

impl Row {
    fn bw(name: &str, size: usize, gbps: f64) -> Row {
        Row {
            name: name.into(),
            size,
            gbps: Some(gbps),
            lat: None,
        }
    }
    fn lat(name: &str, size: usize, l: (f64, f64)) -> Row {
        Row {
            name: name.into(),
            size,
            gbps: None,
            lat: Some(l),
        }
    }
}

fn median(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    let mut v: Vec<f64> = (0..reps).map(|_| f()).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn bytes_per_round(size: usize) -> usize {
    // Enough data per measurement to dominate start-up costs.
    (256usize << 20).max(size * 4)
}

fn memcpy_bw(size: usize) -> f64 {
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let n = bytes_per_round(size) / size;
    let t = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn spawn_peer(kind: &str, arg: &str) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args(["--ibex-peer", kind, arg])
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn peer");
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    (child, out)
}

fn cma_bw(size: usize) -> f64 {
    let (mut child, mut out) = spawn_peer("cma-source", &size.to_string());
    let mut line = String::new();
    out.read_line(&mut line).expect("peer line");
    let mut it = line
        .split_whitespace()
        .map(|x| x.parse::<usize>().expect("number"));
    let (pid, addr) = (it.next().expect("pid"), it.next().expect("addr"));
    let mut dst = vec![0u8; size];
    let n = bytes_per_round(size) / size;
    let read = |dst: &mut [u8]| {
        let local = libc::iovec {
            iov_base: dst.as_mut_ptr().cast(),
            iov_len: size,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: size,
        };
        // SAFETY: `local` covers our own buffer; the kernel checks the remote range.
        let r = unsafe { libc::process_vm_readv(pid as i32, &local, 1, &remote, 1, 0) };
        assert_eq!(
            r as usize,
            size,
            "process_vm_readv: {}",
            std::io::Error::last_os_error()
        );
    };
    read(&mut dst);
    let t = Instant::now();
    for _ in 0..n {
        read(&mut dst);
    }
    let v = (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(child.stdin.take());
    let _ = child.wait();
    v
}

fn raw_tcp_latency(iters: usize) -> (f64, f64) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let (mut child, _out) = spawn_peer("tcp-echo", &l.local_addr().expect("addr").to_string());
    let (mut s, _) = l.accept().expect("accept");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = [0u8; 64];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        s.write_all(&buf).expect("write");
        s.read_exact(&mut buf).expect("read");
        if i >= iters / 10 {
            samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    drop(s);
    let _ = child.wait();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn raw_tcp_bw(size: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let (mut child, _out) = spawn_peer("tcp-sink", &l.local_addr().expect("addr").to_string());
    let (mut s, _) = l.accept().expect("accept");
    s.set_nodelay(true).expect("nodelay");
    let data = vec![5u8; size];
    let n = bytes_per_round(size) / size;
    // Warm-up message, then the timed batch; the peer acks each batch with one byte.
    let mut ack = [0u8; 1];
    let mut batch = |count: usize| {
        s.write_all(&((count * size) as u64).to_le_bytes())
            .expect("hdr");
        for _ in 0..count {
            s.write_all(&data).expect("write");
        }
        s.read_exact(&mut ack).expect("ack");
    };
    batch(1);
    let t = Instant::now();
    batch(n);
    let v = (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(s);
    let _ = child.wait();
    v
}

async fn ibex_pair(provider: &str) -> (Connection, Child) {
    let uri = match provider {
        "shm" => format!(
            "shm://{}",
            std::env::temp_dir()
                .join(format!("ibex-bench-{}.sock", std::process::id()))
                .display()
        ),
        _ => "tcp://127.0.0.1:0".to_string(),
    };
    let l = listen(&uri, bench_config()).await.expect("listen");
    let (child, _out) = spawn_peer("ibex-echo", &l.local_uri());
    let conn = l.accept().await.expect("accept");
    conn.probe_done().await;
    (conn, child)
}

fn bench_config() -> Config {
    Config::from_env().expect("config")
}

async fn ibex_latency(conn: &Connection, iters: usize) -> (f64, f64) {
    let mut msg = vec![0u8; 64];
    msg[0] = MARK_ECHO;
    let msg = Bytes::from(msg);
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        conn.send(msg.clone()).await.expect("send");
        let r = conn.recv().await.expect("recv");
        debug_assert_eq!(r.len(), 64);
        if i >= iters / 10 {
            samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

async fn ibex_bw(conn: &Connection, size: usize, pool: bool) -> f64 {
    let make = |mark: u8| -> Bytes {
        if pool {
            let mut b = conn.alloc(size).expect("pool alloc");
            b.fill(3);
            b[0] = mark;
            b.freeze()
        } else {
            let mut v = vec![3u8; size];
            v[0] = mark;
            Bytes::from(v)
        }
    };
    let (data, last) = (make(MARK_DATA), make(MARK_LAST));
    let n = bytes_per_round(size) / size;
    // Warm-up.
    conn.send(last.clone()).await.expect("send");
    conn.recv().await.expect("ack");
    let t = Instant::now();
    for _ in 0..n - 1 {
        conn.send(data.clone()).await.expect("send");
    }
    conn.send(last.clone()).await.expect("send");
    conn.recv().await.expect("ack");
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

// ---- the peer process -----------------------------------------------------------------

fn peer(kind: &str, arg: &str) {
    match kind {
        "cma-source" => {
            let size: usize = arg.parse().expect("size");
            let buf = vec![9u8; size];
            println!("{} {}", std::process::id(), buf.as_ptr() as usize);
            let _ = std::io::stdout().flush();
            // Stay alive until the parent closes our stdin.
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
            drop(buf);
        }
        "tcp-echo" => {
            let mut s = TcpStream::connect(arg).expect("connect");
            s.set_nodelay(true).expect("nodelay");
            let mut buf = [0u8; 64];
            while s.read_exact(&mut buf).is_ok() {
                if s.write_all(&buf).is_err() {
                    break;
                }
            }
        }
        "tcp-sink" => {
            let mut s = TcpStream::connect(arg).expect("connect");
            let mut buf = vec![0u8; 1 << 20];
            let mut hdr = [0u8; 8];
            while s.read_exact(&mut hdr).is_ok() {
                let mut left = u64::from_le_bytes(hdr) as usize;
                while left > 0 {
                    let n = s.read(&mut buf[..left.min(1 << 20)]).expect("read");
                    if n == 0 {
                        return;
                    }
                    left -= n;
                }
                if s.write_all(&[1]).is_err() {
                    break;
                }
            }
        }
        "ibex-echo" => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let conn = connect(arg, bench_config()).await.expect("connect");
                loop {
                    let Ok(m) = conn.recv().await else { break };
                    // The echo and the last message's one-byte answer; a failed send ends
                    // the peer.
                    let reply = match m.first() {
                        Some(&MARK_ECHO) => m,
                        Some(&MARK_LAST) => {
                            // Its buffer goes back to the transport before the answer.
                            drop(m);
                            Bytes::from_static(&[1])
                        }
                        _ => continue,
                    };
                    if conn.send(reply).await.is_err() {
                        break;
                    }
                }
            });
        }
        other => panic!("unknown peer kind {other}"),
    }
}

// ---- report ---------------------------------------------------------------------------

fn find<'a>(rows: &'a [Row], name: &str, size: usize) -> Option<&'a Row> {
    rows.iter().find(|r| r.name == name && r.size == size)
}

fn fmt_size(s: usize) -> String {
    if s >= 1 << 20 {
        format!("{} MiB", s >> 20)
    } else if s >= 1024 {
        format!("{} KiB", s >> 10)
    } else {
        format!("{s} B")
    }
}

fn report(rows: &[Row], json: bool) {
    if json {
        for r in rows {
            match (r.gbps, r.lat) {
                (Some(g), _) => println!(
                    "{{\"name\":\"{}\",\"size\":{},\"gbps\":{g:.3}}}",
                    r.name, r.size
                ),
                (_, Some((p50, p99))) => println!(
                    "{{\"name\":\"{}\",\"size\":{},\"p50_us\":{p50:.3},\"p99_us\":{p99:.3}}}",
                    r.name, r.size
                ),
                _ => {}
            }
        }
    }
    println!(
        "\n{:<28} {:>8} {:>12} {:>12}",
        "measurement", "size", "GB/s", "p50/p99 µs"
    );
    for r in rows {
        let bw = r.gbps.map(|g| format!("{g:.2}")).unwrap_or_default();
        let lat = r
            .lat
            .map(|(a, b)| format!("{a:.2}/{b:.2}"))
            .unwrap_or_default();
        println!(
            "{:<28} {:>8} {:>12} {:>12}",
            r.name,
            fmt_size(r.size),
            bw,
            lat
        );
    }
    println!("\nratios (same run):");
    let ratio = |label: &str, a: Option<&Row>, b: Option<&Row>, lat: bool| {
        if let (Some(a), Some(b)) = (a, b) {
            let v = if lat {
                a.lat.map(|x| x.0).unwrap_or(f64::NAN) / b.lat.map(|x| x.0).unwrap_or(f64::NAN)
            } else {
                a.gbps.unwrap_or(f64::NAN) / b.gbps.unwrap_or(f64::NAN)
            };
            println!("  {label:<58} {v:>6.2}");
        }
    };
    let m16 = 16 << 20;
    ratio(
        "shm 64 B one-way p50 / raw tcp p50 (lower is better)",
        find(rows, "ibex shm", 64),
        find(rows, "raw tcp (blocking)", 64),
        true,
    );
    ratio(
        "tcp 64 B one-way p50 / raw tcp p50",
        find(rows, "ibex tcp", 64),
        find(rows, "raw tcp (blocking)", 64),
        true,
    );
    ratio(
        "shm 16 MiB (CMA) / bare process_vm_readv (target >= 0.90)",
        find(rows, "ibex shm", m16),
        find(rows, "process_vm_readv (bare)", m16),
        false,
    );
    ratio(
        "shm 16 MiB registered pool / shm CMA (target >= 2)",
        find(rows, "ibex shm (registered pool)", m16),
        find(rows, "ibex shm", m16),
        false,
    );
    ratio(
        "tcp 16 MiB / raw tcp 16 MiB (target >= 0.80)",
        find(rows, "ibex tcp", m16),
        find(rows, "raw tcp", m16),
        false,
    );
    for s in [64 << 10, 1 << 20, m16] {
        ratio(
            &format!("shm {} / memcpy", fmt_size(s)),
            find(rows, "ibex shm", s),
            find(rows, "memcpy", s),
            false,
        );
    }
    ratio(
        "registered pool 16 MiB / memcpy",
        find(rows, "ibex shm (registered pool)", m16),
        find(rows, "memcpy", m16),
        false,
    );
    let _ = Duration::ZERO;
}
