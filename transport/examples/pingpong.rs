//! A first look at Ibex: two endpoints exchange messages of growing size over shm and tcp
//! and print what the transport did (eager or rendezvous, copies, the probed threshold).
//!
//! `cargo run --release -p ibex-transport --example pingpong`

use std::time::Instant;

use bytes::Bytes;
use ibex_transport::{Config, connect, listen};

#[tokio::main]
async fn main() -> ibex_transport::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let sock = std::env::temp_dir().join(format!("ibex-pingpong-{}.sock", std::process::id()));
    for uri in [
        format!("shm://{}", sock.display()),
        "tcp://127.0.0.1:0".to_string(),
    ] {
        let listener = listen(&uri, Config::from_env()?).await?;
        let at = listener.local_uri();
        let server = tokio::spawn(async move {
            let conn = listener.accept().await?;
            // Echo every message back until the client closes.
            while let Ok(m) = conn.recv().await {
                conn.send(m).await?;
            }
            Ok::<_, ibex_transport::Error>(())
        });
        let client = connect(&at, Config::from_env()?).await?;
        let threshold = client.probe_done().await;
        println!(
            "== {at}: provider {}, eager threshold {threshold} B (probed)",
            client.provider()
        );
        println!("{:>10} {:>8} {:>14}", "size", "rounds", "round trip µs");
        for shift in [6, 10, 14, 16, 20, 24] {
            let size = 1usize << shift;
            let msg = Bytes::from((0..size).map(|i| i as u8).collect::<Vec<u8>>());
            let rounds = if size >= 1 << 20 { 10 } else { 1000 };
            let t = Instant::now();
            for _ in 0..rounds {
                client.send(msg.clone()).await?;
                let back = client.recv().await?;
                assert_eq!(back, msg, "echo corrupted a {size}-byte message");
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
            println!("{size:>10} {rounds:>8} {us:>14.1}");
        }
        println!("{}\n", client.stats());
        client.close().await;
        drop(client);
        server
            .await
            .map_err(|e| ibex_transport::Error::Config(e.to_string()))??;
    }
    Ok(())
}
