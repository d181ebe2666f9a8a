//! `ibex-bench auto`: which provider `connect_auto` picks between two endpoints, checked by
//! moving a message over it. The emulated cluster (`scripts/cluster-netns.sh`) runs the
//! listener in one network namespace and the client in another: they share a filesystem,
//! so the listener's shm socket is visible to the client, and yet it must pick tcp.

use std::time::Duration;

use bytes::Bytes;
use ibex_transport::Config;

use crate::Res;

/// How long the client's connect and echo may take.
const DEADLINE: Duration = Duration::from_secs(20);

/// Serves `listen_auto` at `host_port` until killed: echoes one message per connection and
/// prints `accepted PROVIDER` for each. Prints `listening HOST:PORT` first.
pub fn serve(host_port: &str) -> Res<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let config = Config::default().with_env()?;
        let l = ibex_transport::listen_auto(host_port, config).await?;
        println!("listening {}", l.local_uri());
        loop {
            let c = l.accept().await?;
            println!("accepted {}", c.provider());
            tokio::spawn(async move {
                if let Ok(m) = c.recv().await {
                    let _ = c.send(m).await;
                }
                c.close().await;
            });
        }
    })
}

/// Connects with `connect_auto`, echoes a message and prints `provider PROVIDER`; fails if
/// the provider is not `want` (when given) or the echo differs.
pub fn check(host_port: &str, want: Option<&str>) -> Res<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let config = Config::default().with_env()?;
        let chosen = ibex_transport::choose_auto(host_port, &config)?;
        let work = async {
            let c = ibex_transport::connect_auto(host_port, config).await?;
            let msg = Bytes::from((0..100_000u32).map(|i| i as u8).collect::<Vec<u8>>());
            c.send(msg.clone()).await?;
            let back = c.recv().await?;
            let provider = c.provider();
            c.close().await;
            Ok::<_, ibex_transport::Error>((provider, back == msg))
        };
        let (provider, same) = tokio::time::timeout(DEADLINE, work).await.map_err(|_| {
            format!("connect_auto to {host_port} and an echo took over {DEADLINE:?}")
        })??;
        println!("provider {provider} (first choice {chosen})");
        if !same {
            return Err(format!("the echo over {provider} came back different").into());
        }
        if let Some(w) = want
            && w != provider
        {
            return Err(
                format!("connect_auto to {host_port} picked {provider}, expected {w}").into(),
            );
        }
        Ok(())
    })
}
