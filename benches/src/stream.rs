//! The tcp floor: one plain TCP stream between two processes, no transport, no framing.
//! The sender writes `size`-byte buffers (tokio, `write_all`) as fast as the socket takes
//! them, the receiver reads into one buffer of the same size and drops the bytes. What it
//! moves is the most any protocol over one TCP connection between the same two endpoints
//! can move; Ibex tcp's large transfers are judged against it (`compare`'s ps-step bar).
//!
//! Locally the receiver is this binary re-run as `tcp-stream --listen`; across hosts (or
//! network namespaces) start that by hand and name it with `--connect`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Res;
use crate::report::{Record, self_peak_rss_kib};

/// Receives streams at `addr` until killed, one at a time, discarding the bytes; prints
/// the bound address first.
pub fn listen(addr: &str, size: usize) -> Res<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let l = tokio::net::TcpListener::bind(addr).await?;
        println!("{}", l.local_addr()?);
        loop {
            let (mut s, _) = l.accept().await?;
            let mut buf = vec![0u8; size.max(1)];
            // A stream ends with the sender's shutdown, or fails; either way the next.
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        }
    })
}

/// Streams `size`-byte writes to `connect` (or to a receiver process it starts) for
/// `warmup` then `duration`, and reports the measured part's rate.
pub fn measure(
    connect: Option<&str>,
    size: usize,
    warmup: Duration,
    duration: Duration,
) -> Res<Record> {
    let mut child = None;
    let addr = match connect {
        Some(a) => a.to_string(),
        None => {
            let mut c = Command::new(std::env::current_exe()?)
                .args(["tcp-stream", "--listen", "127.0.0.1:0"])
                .args(["--size", &size.to_string()])
                .stdout(Stdio::piped())
                .spawn()?;
            let out = c.stdout.take().ok_or("receiver stdout")?;
            let mut line = String::new();
            BufReader::new(out).read_line(&mut line)?;
            child = Some(c);
            line.trim().to_string()
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // A receiver that stops reading must not hang the sender: the whole run is bounded.
    let limit = warmup + duration + Duration::from_secs(30);
    let r = rt.block_on(async {
        tokio::time::timeout(limit, send(&addr, size, warmup, duration))
            .await
            .unwrap_or_else(|_| Err(format!("the stream to {addr} stalled past {limit:?}").into()))
    });
    if let Some(mut c) = child {
        let _ = c.kill();
        let _ = c.wait();
    }
    let (bytes, secs) = r?;
    let writes = bytes / size.max(1) as u64;
    let mb_s = if secs > 0.0 {
        bytes as f64 / secs / 1e6
    } else {
        0.0
    };
    let us = if writes > 0 {
        secs * 1e6 / writes as f64
    } else {
        0.0
    };
    Ok(Record {
        bench: "tcp-stream".into(),
        transport: "local".into(),
        payload: "1 stream".into(),
        bytes: size,
        window: 1,
        topology: "1x1".into(),
        calls: writes,
        p50_us: us,
        p99_us: us,
        p999_us: us,
        mean_us: us,
        mb_s,
        rpc_s: if secs > 0.0 {
            writes as f64 / secs
        } else {
            0.0
        },
        client_rss_kib: self_peak_rss_kib(),
        server_rss_kib: 0,
        round: None,
    })
}

/// Bytes written in the measured window and its length in seconds.
async fn send(addr: &str, size: usize, warmup: Duration, duration: Duration) -> Res<(u64, f64)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let buf = vec![0x5au8; size.max(1)];
    let start = Instant::now();
    let mut measured: Option<(Instant, u64)> = None;
    loop {
        s.write_all(&buf).await?;
        let now = Instant::now();
        match &mut measured {
            None if now >= start + warmup => measured = Some((now, 0)),
            None => {}
            Some((from, bytes)) => {
                *bytes += buf.len() as u64;
                if now >= *from + duration {
                    let secs = now.duration_since(*from).as_secs_f64();
                    let bytes = *bytes;
                    s.shutdown().await?;
                    return Ok((bytes, secs));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_to_a_receiver_thread_moves_bytes() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let rx = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut sink = std::io::sink();
            std::io::copy(&mut s, &mut sink).unwrap()
        });
        let r = measure(
            Some(&addr),
            64 << 10,
            Duration::ZERO,
            Duration::from_millis(50),
        )
        .unwrap();
        let got = rx.join().unwrap();
        assert!(r.calls > 0 && r.mb_s > 0.0, "{r:?}");
        assert!(got >= r.calls * (64 << 10), "{got} bytes received");
        assert_eq!(r.bench, "tcp-stream");
    }
}
