//! The `ibex-ps` binary against hostile peers while an honest worker trains on it: silent
//! sockets, junk, a wrong protocol version, malformed call framing, and well-formed gRPC
//! requests that lie (unknown variables, wrong shapes, forged descriptors, huge
//! definitions, another worker's id, a step that never comes).
//!
//! Asserts: the honest worker loses no update (its final values equal a reference computed
//! here with the same f32 operations); every bad peer gets an error or a close, never
//! silence; the PS's RSS stays bounded; the PS never panics and is still serving at the
//! end.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use ibex_proto::ps::v1 as pb;
use ibex_proto::ps::v1::parameter_server_ibex::ParameterServerClient;
use ibex_test_support::{Launch, Server};
use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, TransportKind, VarSpec};
use tonic::Code;

const STEPS: u64 = 60;
/// A hang guard, not a performance assertion.
const WITHIN: Duration = Duration::from_secs(20);

fn vars() -> Vec<VarSpec> {
    let v = |name: &str, optimizer| VarSpec {
        name: name.into(),
        dtype: Dtype::F32,
        shape: vec![64],
        init: Init::Normal { std: 1.0, seed: 5 },
        optimizer,
        sparse: false,
    };
    vec![
        v(
            "a",
            Optimizer::Momentum {
                lr: 0.05,
                momentum: 0.9,
            },
        ),
        v("b", Optimizer::Sgd { lr: 0.1 }),
    ]
}

/// Depends on the values and the step, so a lost or repeated step shows in the result.
fn grad(vals: &[f32], k: u64) -> Vec<f32> {
    vals.iter().map(|x| x * 0.5 + k as f32 * 0.01).collect()
}

fn reference(a0: &[f32], b0: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut a, mut b, mut v) = (a0.to_vec(), b0.to_vec(), vec![0f32; a0.len()]);
    for k in 0..STEPS {
        let (ga, gb) = (grad(&a, k), grad(&b, k));
        for i in 0..a.len() {
            v[i] = 0.9 * v[i] + ga[i];
            a[i] -= 0.05 * v[i];
            b[i] -= 0.1 * gb[i];
        }
    }
    (a, b)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Reads a raw socket until the server closes it (or resets it); fails on silence.
fn closed_by_server(mut s: TcpStream, what: &str) {
    s.set_read_timeout(Some(WITHIN)).unwrap();
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!("{what}: the PS left the socket open for {WITHIN:?}")
            }
            Err(_) => return,
        }
    }
}

/// Waits until the PS has written to `s` or closed it, without consuming what it wrote.
fn answered(s: &TcpStream) {
    s.set_read_timeout(Some(WITHIN)).unwrap();
    match s.peek(&mut [0u8; 1]) {
        // Its preface, or (0 bytes) a close.
        Ok(_) => {}
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut =>
        {
            panic!("the PS left a silent socket unanswered for {WITHIN:?}")
        }
        // A reset is a close too.
        Err(_) => {}
    }
}

/// A gRPC call packet for the PS service (see transport/src/grpc/wire.rs).
fn call_packet(call: u32, method: &str, header_count: u16) -> Bytes {
    let path = format!("/ibex.ps.v1.ParameterServer/{method}");
    let mut h = BytesMut::new();
    h.put_u16(path.len() as u16);
    h.put_slice(path.as_bytes());
    h.put_u16(header_count);
    let mut b = BytesMut::new();
    b.put_u32(call);
    b.put_u8(1 | 16); // HEAD | END
    b.put_u32(h.len() as u32);
    b.put_slice(&h);
    b.freeze()
}

fn spawn_ps(uri: &str) -> Server {
    Launch::new(env!("CARGO_BIN_EXE_ibex-ps"))
        .listen(uri)
        .args(["--shard", "0", "--num-workers", "1", "--mode", "sync"])
        .args(["--sync-timeout-secs", "2", "--max-elements", "16777216"])
        // Long enough that an honest set-up on a loaded machine is not cut short, and the
        // silent sockets are still waiting when the newcomers come.
        .env("IBEX_HANDSHAKE_TIMEOUT_MS", "5000")
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("ibex-ps")
}

fn tensor(name: &str, shape: &[u64], data: pb::tensor::Data) -> pb::Tensor {
    pb::Tensor {
        name: name.into(),
        dtype: pb::Dtype::F32 as i32,
        shape: shape.to_vec(),
        data: Some(data),
    }
}

fn inline(n: usize) -> pb::tensor::Data {
    pb::tensor::Data::Inline(vec![0u8; n * 4].into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_training_job_survives_hostile_peers_on_the_same_ps() {
    let port = common::free_port();
    let addr = format!("127.0.0.1:{port}");
    let uri = format!("tcp://{addr}");
    let ps = spawn_ps(&uri);
    let pid = ps.id();
    let spec = ClusterSpec {
        ps: vec![addr.clone()],
        workers: vec!["127.0.0.1:0".into()],
        transport: TransportKind::Tcp,
        timeouts: Default::default(),
    };
    let w = common::connect_worker(&spec, 0)
        .await
        .expect("connect to the PS");
    w.create_variables(&vars()).await.unwrap();
    let init = w.pull(&["a", "b"], 0).await.unwrap();
    let rss0 = rss_kib(pid);

    // The honest worker trains throughout, a little slowly so the bad peers overlap it.
    let trainer = tokio::spawn(async move {
        for k in 0..STEPS {
            let vals = w
                .pull(&["a", "b"], k)
                .await
                .map_err(|e| format!("pull {k}: {e}"))?;
            let (ga, gb) = (grad(&vals[0], k), grad(&vals[1], k));
            w.push(k, &[("a", &ga), ("b", &gb)])
                .await
                .map_err(|e| format!("push {k}: {e}"))?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        w.pull(&["a", "b"], STEPS)
            .await
            .map_err(|e| format!("final pull: {e}"))
    });

    let mut cases = 0;
    let mut peak = rss0;

    // 300 sockets that connect and say nothing: each is closed at the set-up deadline.
    // More than the 128 set-ups the PS lets wait at once: the honest newcomers below must
    // take the slots of the longest-waiting ones rather than be refused.
    let silent: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    // A connect returns once the socket is in the PS's listen queue, not once the PS has
    // taken it off; a starved PS could still be handing out slots when the newcomers come.
    // Each socket is answered when it is taken off: a slot holder gets the PS's preface,
    // one past the cap a close. Once all are answered, every slot holder has been waiting
    // since then, and past the eviction age (a tenth of the set-up deadline, at most
    // 250 ms) the longest-waiting one must give way to a newcomer.
    for s in &silent {
        answered(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    cases += 1;
    // Junk instead of a preface, and a preface of another wire version.
    for i in 0..10 {
        let mut s = TcpStream::connect(&addr).unwrap();
        let junk: Vec<u8> = (0..(1usize << 20)).map(|j| (j * 7 + i) as u8).collect();
        let _ = s.write_all(&junk);
        closed_by_server(s, "1 MiB of junk");
    }
    cases += 1;
    {
        let cfg = ibex_transport::Config::default();
        let mut pre = ibex_transport::preface::Preface::ours(&cfg, Vec::new())
            .unwrap()
            .encode(ibex_transport::preface::Provider::Tcp);
        pre[8] = pre[8].wrapping_add(7); // the version byte, after the 8-byte magic
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(&pre).unwrap();
        closed_by_server(s, "a wrong version");
    }
    cases += 1;
    peak = peak.max(rss_kib(pid));

    // The call framing's worst: a header count of 40000 (once a panic in the PS).
    let cfg = ibex_transport::Config::from_env().unwrap();
    let c = ibex_transport::connect(&uri, cfg.clone())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "an honest connection during the silent flood: {e}\nPS log:\n{}",
                ps.output()
            )
        });
    c.send(call_packet(1, "Stats", 40000)).await.unwrap();
    let why = tokio::time::timeout(WITHIN, async {
        loop {
            if let Err(e) = c.recv().await {
                return e.to_string();
            }
        }
    })
    .await
    .expect("the PS left a bad call framing open");
    assert!(why.contains("header"), "closed with {why:?}");
    cases += 1;

    // Well-formed requests that lie: each is refused with a status naming the problem.
    // A new client connects and is answered while the silent sockets are still open.
    let t = Instant::now();
    let ch = ibex_transport::grpc::Channel::connect_with_config(&uri, cfg)
        .await
        .unwrap_or_else(|e| panic!("an honest channel during the silent flood: {e}"));
    let mut bad = ParameterServerClient::new(ch);
    bad.stats(pb::StatsRequest {}).await.unwrap();
    let honest_during_flood = t.elapsed();
    let push = |grads: Vec<pb::Tensor>, worker: u32, step: u64| pb::PushRequest {
        step,
        worker,
        grads,
        release: vec![],
    };
    let forged = pb::tensor::Data::Remote(pb::RemoteRef {
        descriptor: vec![0x41; 16].into(),
        len: 256,
        lease: 0,
    });
    let huge = pb::VariableDef {
        name: "huge".into(),
        dtype: pb::Dtype::F32 as i32,
        shape: vec![1 << 30, 1 << 10],
        ..Default::default()
    };
    let mut wrong_row = huge.clone();
    wrong_row.name = "rows".into();
    wrong_row.shape = vec![4, 8];
    wrong_row.full_shape = vec![16, 9];
    let mut timed_out = tonic::Request::new(pb::PullRequest {
        names: vec!["a".into()],
        step: 1 << 40,
        worker: 0,
        release: vec![],
    });
    timed_out.set_timeout(Duration::from_secs(1));
    let refusals: Vec<(&str, Result<(), tonic::Status>, &[Code])> = vec![
        (
            "an unknown variable",
            bad.push(push(vec![tensor("nope", &[64], inline(64))], 0, 0))
                .await
                .map(drop),
            &[Code::NotFound],
        ),
        (
            "a shape mismatch",
            bad.push(push(vec![tensor("a", &[8, 8], inline(64))], 0, 0))
                .await
                .map(drop),
            &[Code::InvalidArgument],
        ),
        (
            "short data",
            bad.push(push(vec![tensor("a", &[64], inline(63))], 0, 0))
                .await
                .map(drop),
            &[Code::InvalidArgument],
        ),
        (
            "a forged descriptor",
            bad.push(push(vec![tensor("a", &[64], forged)], 0, 0))
                .await
                .map(drop),
            &[
                Code::InvalidArgument,
                Code::Unavailable,
                Code::Internal,
                Code::FailedPrecondition,
            ],
        ),
        (
            "another worker's id",
            bad.push(push(vec![tensor("a", &[64], inline(64))], 7, 0))
                .await
                .map(drop),
            &[Code::InvalidArgument],
        ),
        (
            "a huge definition",
            bad.create_variables(pb::CreateVariablesRequest { vars: vec![huge] })
                .await
                .map(drop),
            &[Code::ResourceExhausted, Code::InvalidArgument],
        ),
        (
            "a partition whose row length differs from the full shape's",
            bad.create_variables(pb::CreateVariablesRequest {
                vars: vec![wrong_row],
            })
            .await
            .map(drop),
            &[Code::InvalidArgument],
        ),
        (
            "a step that never comes",
            bad.pull(timed_out).await.map(drop),
            &[Code::DeadlineExceeded],
        ),
    ];
    for (what, r, codes) in &refusals {
        match r {
            Ok(()) => panic!("{what}: accepted"),
            Err(s) => {
                assert!(
                    codes.contains(&s.code()),
                    "{what}: {:?} {}",
                    s.code(),
                    s.message()
                );
                assert!(!s.message().is_empty(), "{what}: no message");
            }
        }
        cases += 1;
    }
    peak = peak.max(rss_kib(pid));

    // The silent sockets were closed by the deadline, each one.
    for s in silent {
        closed_by_server(s, "a silent socket");
    }

    let got = tokio::time::timeout(Duration::from_secs(120), trainer)
        .await
        .expect("training hung")
        .unwrap()
        .unwrap_or_else(|e| panic!("the honest worker failed: {e}"));
    let (ra, rb) = reference(&init[0], &init[1]);
    for (g, r) in got.iter().zip([&ra, &rb]) {
        for (x, y) in g.iter().zip(r.iter()) {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "got {g:?}\nexpected {r:?}"
            );
        }
    }
    peak = peak.max(rss_kib(pid));

    // Still serving, and never panicked.
    let mut ps = ps;
    assert!(ps.try_wait().unwrap().is_none(), "the PS exited");
    let stats = bad.stats(pb::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.step, STEPS, "every honest step applied once");
    let log = ps.output();
    assert!(!log.contains("panicked"), "the PS panicked:\n{log}");
    eprintln!(
        "ibex-ps: {cases} hostile cases beside {STEPS} honest steps; a new client connected and \
         answered in {honest_during_flood:?} while 300 silent sockets were open; PS RSS {} MiB \
         at start, peak {} MiB",
        rss0 >> 10,
        peak >> 10
    );
    assert!(
        honest_during_flood < WITHIN,
        "a new client waited {honest_during_flood:?} behind silent sockets"
    );
    assert!(
        peak.saturating_sub(rss0) < 256 << 10,
        "the PS grew from {} MiB to {} MiB",
        rss0 >> 10,
        peak >> 10
    );
}

/// 40 connections open calls with a head and 64 KiB of data but no end (1.25 GiB offered),
/// against a PS with a 128 MiB budget: its RSS stays within the budget plus a fixed
/// overhead (the transport's receive queues of the paused connections, at most
/// `credits x slot_size` = 4 MiB each, and the process's own 64 MiB), a new client's
/// `Stats` call every 250 ms is answered within a second, and once the flood leaves the
/// RSS falls back within the budget (freed memory is given back to the system).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ps_stays_within_its_memory_budget() {
    const BUDGET_MIB: u64 = 128;
    const CONNS: usize = 40;
    const CALLS: u32 = 400;
    let port = common::free_port();
    let uri = format!("tcp://127.0.0.1:{port}");
    let mut ps = Launch::new(env!("CARGO_BIN_EXE_ibex-ps"))
        .listen(&uri)
        .args(["--shard", "0", "--num-workers", "1", "--mode", "async"])
        .args(["--max-memory", &format!("{BUDGET_MIB}M")])
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("ibex-ps");
    let pid = ps.id();
    let config = ibex_transport::Config::default();
    let honest = |uri: String| async move {
        let ch = ibex_transport::grpc::Channel::connect(&uri).await?;
        let t = Instant::now();
        ParameterServerClient::new(ch)
            .stats(pb::StatsRequest {})
            .await
            .map_err(|s| ibex_transport::Error::PeerGone(s.to_string()))?;
        Ok::<Duration, ibex_transport::Error>(t.elapsed())
    };
    honest(uri.clone()).await.expect("the PS answers");
    let rss0 = rss_kib(pid);

    let mut body = BytesMut::new();
    body.put_u8(0);
    body.put_u32(64 << 10);
    body.put_slice(&[7u8; 64 << 10]);
    let body = body.freeze();
    let mut floods = Vec::new();
    for _ in 0..CONNS {
        let c = ibex_transport::connect(&uri, config.clone())
            .await
            .expect("connect");
        let body = body.clone();
        floods.push(tokio::spawn(async move {
            for id in 0..CALLS {
                // HEAD and DATA, never END: the handler waits for the rest of its request.
                let mut p = BytesMut::from(&call_packet(1 + 2 * id, "Push", 0)[..]);
                p[4] = 1 | 2;
                p.put_u32(body.len() as u32);
                p.put_slice(&body);
                if c.send(p.freeze()).await.is_err() {
                    return;
                }
            }
            std::future::pending::<()>().await;
        }));
    }
    let mut peak = rss0;
    let mut slowest = Duration::ZERO;
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let took = tokio::time::timeout(Duration::from_secs(1), honest(uri.clone()))
            .await
            .expect("a new client waited more than 1 s for Stats")
            .expect("a new client's Stats call");
        slowest = slowest.max(took);
        peak = peak.max(rss_kib(pid));
    }
    let overhead_mib = 64 + 4 * CONNS as u64;
    eprintln!(
        "ibex-ps: {CONNS} connections offered {} MiB of unended calls; PS RSS {} MiB at \
         start, peak {} MiB (budget {BUDGET_MIB} MiB + {overhead_mib} MiB overhead); \
         slowest Stats {slowest:?}",
        (CONNS as u64 * u64::from(CALLS) * body.len() as u64) >> 20,
        rss0 >> 10,
        peak >> 10
    );
    assert!(
        peak.saturating_sub(rss0) <= (BUDGET_MIB + overhead_mib) << 10,
        "the PS grew from {} MiB to {} MiB",
        rss0 >> 10,
        peak >> 10
    );
    for f in floods {
        f.abort();
    }
    // The flood's connections close with their tasks; what they held is given back.
    let t = Instant::now();
    loop {
        let rss = rss_kib(pid);
        if rss.saturating_sub(rss0) <= BUDGET_MIB << 10 {
            break;
        }
        assert!(
            t.elapsed() < WITHIN,
            "the PS still holds {} MiB over its start after the flood left",
            rss.saturating_sub(rss0) >> 10
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    honest(uri.clone())
        .await
        .expect("the PS answers after the flood");
    assert!(ps.try_wait().unwrap().is_none(), "the PS exited");
    let log = ps.output();
    assert!(!log.contains("panicked"), "the PS panicked:\n{log}");
}
