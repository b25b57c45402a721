//! A private Mosquitto per test, until the shared harness (`ferry-tests`) is
//! merged: a free loopback port, persistence in a temporary directory, SIGTERM
//! to stop (it saves its sessions), the same port on restart.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use super::wait_for;

pub struct Mosquitto {
    port: u16,
    config: PathBuf,
    child: Option<Child>,
    _dir: TempDir,
}

impl Mosquitto {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let config = dir.path().join("mosquitto.conf");
        std::fs::write(
            &config,
            format!(
                "listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n\
                 max_inflight_messages 0\npersistence true\npersistence_location {}/\n\
                 user root\nlog_dest stderr\nlog_type error\n",
                dir.path().display()
            ),
        )
        .expect("writing mosquitto.conf");
        let mut broker = Self {
            port,
            config,
            child: None,
            _dir: dir,
        };
        broker.launch().await;
        broker
    }

    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    async fn launch(&mut self) {
        let binary = ["/usr/sbin/mosquitto", "/usr/bin/mosquitto"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .unwrap_or("mosquitto");
        let child = Command::new(binary)
            .arg("-c")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting mosquitto");
        self.child = Some(child);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        wait_for(
            "mosquitto to accept connections",
            Duration::from_secs(10),
            || TcpStream::connect(addr).is_ok(),
        )
        .await;
    }

    /// SIGTERM and wait: Mosquitto saves its sessions and queued messages.
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let status = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status()
                .expect("kill -TERM");
            assert!(status.success());
            wait_for("mosquitto to exit", Duration::from_secs(10), || {
                matches!(child.try_wait(), Ok(Some(_)))
            })
            .await;
        }
    }

    pub async fn restart(&mut self) {
        self.stop().await;
        self.launch().await;
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
    }
}
