//! A fresh PostgreSQL database per test.
//!
//! [`TestDatabase::create`] makes a database `ferry_test_<unique>` on the server named by
//! `$FERRY_TEST_PG` (libpq key=value form, default `host=127.0.0.1 port=5432 user=postgres`; the
//! user must be allowed to create databases, with trust auth or a `password=` in the string) and
//! drops it when the value is dropped (best effort, `WITH (FORCE)`, so connections a test left
//! open do not keep it alive).

use std::time::Duration;

use anyhow::Context;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

use crate::ids;

/// The server used when `$FERRY_TEST_PG` is not set.
pub const DEFAULT_SERVER: &str = "host=127.0.0.1 port=5432 user=postgres";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A database that exists for the life of the value.
pub struct TestDatabase {
    server: String,
    name: String,
}

impl TestDatabase {
    /// Creates a new, empty database on the test server.
    pub async fn create() -> anyhow::Result<Self> {
        let server = server();
        let name = ids::unique("ferry_test").replace('-', "_");
        let admin = connect(&format!("{server} dbname=postgres"))
            .await
            .with_context(|| {
                format!(
                    "connecting to PostgreSQL ({server}); run ./scripts/test.sh (or \
                     ./scripts/setup.sh), or set FERRY_TEST_PG"
                )
            })?;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .with_context(|| format!("creating the database {name}"))?;
        Ok(Self { server, name })
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The libpq key=value connection string (`host=... port=... user=... dbname=...`).
    pub fn connection_string(&self) -> String {
        format!("{} dbname={}", self.server, self.name)
    }

    /// The connection URL, `postgres://user[:password]@host:port/dbname` (for TCP servers).
    pub fn url(&self) -> anyhow::Result<String> {
        let (host, port) = self.server_address()?;
        self.url_via(&format!("{host}:{port}"))
    }

    /// The server's TCP host and port.
    pub fn server_address(&self) -> anyhow::Result<(String, u16)> {
        let config: Config = self
            .connection_string()
            .parse()
            .context("parsing the connection string")?;
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => host.clone(),
            _ => anyhow::bail!("FERRY_TEST_PG names no TCP host, so there is no URL for it"),
        };
        Ok((host, config.get_ports().first().copied().unwrap_or(5432)))
    }

    /// The connection URL with another `host:port` (a proxy in front of the server).
    pub fn url_via(&self, address: &str) -> anyhow::Result<String> {
        let config: Config = self
            .connection_string()
            .parse()
            .context("parsing the connection string")?;
        let user = config.get_user().unwrap_or("postgres");
        let password = config
            .get_password()
            .map(|password| format!(":{}", String::from_utf8_lossy(password)))
            .unwrap_or_default();
        Ok(format!(
            "postgres://{user}{password}@{address}/{}",
            self.name
        ))
    }

    /// A connection to the database (its driver task runs on the current runtime).
    pub async fn connect(&self) -> anyhow::Result<Client> {
        connect(&self.connection_string())
            .await
            .with_context(|| format!("connecting to the database {}", self.name))
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        // Drop cannot await, and may run inside a runtime: drop the database from a thread with
        // its own runtime, and wait for it so the database is gone when the test ends.
        let server = self.server.clone();
        let name = self.name.clone();
        let dropper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("building a runtime")?;
            runtime.block_on(async {
                let admin = connect(&format!("{server} dbname=postgres")).await?;
                admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
                    .context("dropping the database")
            })
        });
        match dropper.join() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!(
                "ferry-tests: could not drop the database {}: {error:#}",
                self.name
            ),
            Err(_) => eprintln!("ferry-tests: dropping the database {} panicked", self.name),
        }
    }
}

/// `$FERRY_TEST_PG` or [`DEFAULT_SERVER`].
pub fn server() -> String {
    std::env::var("FERRY_TEST_PG").unwrap_or_else(|_| DEFAULT_SERVER.to_owned())
}

async fn connect(connection_string: &str) -> anyhow::Result<Client> {
    let mut config: Config = connection_string
        .parse()
        .with_context(|| format!("parsing the connection string {connection_string:?}"))?;
    config.connect_timeout(CONNECT_TIMEOUT);
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        // The connection ends when the client is dropped; an error is already reported to the
        // client's pending calls.
        let _ = connection.await;
    });
    Ok(client)
}
