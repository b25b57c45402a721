//! mTLS against the control plane process: certificates made at test time
//! (one CA the server trusts, one it does not). A certificate names its
//! principal with its `ferry://ROLE/NAME` SAN URI.

use ferry_shared::api::v1 as pb;
use ferry_shared::auth::client::ClientAuth;
use pb::config_service_client::ConfigServiceClient;
use tonic::Code;

use super::rpcs::{apply, connect};
use super::support::{Ca, Server, call, write};

const LIST_CONFIGS: &str = "/ferry.v1.ConfigService/ListConfigs";

/// A channel to `server` over TLS trusting `ca`, with the client
/// certificate `identity` (certificate and key PEM) when given.
async fn tls_channel(
    server: &Server,
    ca: &Ca,
    identity: Option<(String, String)>,
    name: &str,
) -> anyhow::Result<tonic::transport::Channel> {
    let dir = server.dir.path();
    let ca_path = write(dir, "trusted-ca.crt", &ca.pem())?;
    let files = identity
        .map(|(cert, key)| -> anyhow::Result<_> {
            Ok((
                write(dir, &format!("{name}.crt"), &cert)?,
                write(dir, &format!("{name}.key"), &key)?,
            ))
        })
        .transpose()?;
    let auth = ClientAuth::new(
        None,
        Some(std::path::Path::new(&ca_path)),
        files.as_ref().map(|(c, _)| std::path::Path::new(c)),
        files.as_ref().map(|(_, k)| std::path::Path::new(k)),
    )?;
    let endpoint = auth
        .endpoint(&format!("https://{}", server.addr))
        .map_err(anyhow::Error::msg)?;
    endpoint
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("connecting as {name}: {e:?}"))
}

#[tokio::test]
async fn client_certificates_name_their_principal_and_no_other() -> anyhow::Result<()> {
    let ca = Ca::new("ferry test CA")?;
    let other = Ca::new("another CA")?;
    let dir = tempfile::tempdir()?;
    let (cert, key) = ca.leaf(&["localhost", "127.0.0.1"], &[])?;
    let flags = [
        "--tls-cert".to_owned(),
        write(dir.path(), "server.crt", &cert)?,
        "--tls-key".to_owned(),
        write(dir.path(), "server.key", &key)?,
        "--client-ca".to_owned(),
        write(dir.path(), "ca.crt", &ca.pem())?,
    ];
    let cp = Server::control_plane(dir, &flags).await?;

    // An operator certificate applies a bridge for agents at site a.
    let operator = tls_channel(
        &cp,
        &ca,
        Some(ca.leaf(&[], &["ferry://operator/alice"])?),
        "alice",
    )
    .await?;
    ConfigServiceClient::new(operator)
        .apply_config(apply("mine", "a", None))
        .await?;

    // The agent certificate of edge-01 opens edge-01's stream, not edge-02's.
    let agent = Some(ca.leaf(&[], &["ferry://agent/edge-01"])?);
    let channel = tls_channel(&cp, &ca, agent.clone(), "edge-01").await?;
    let (_stream, own) = connect(channel, None, "edge-01", "a").await?;
    let own = own.map_err(|s| anyhow::anyhow!("own stream refused: {s:?}"))?;
    assert!(
        matches!(own.message, Some(pb::control_message::Message::Push(_))),
        "{own:?}"
    );
    let channel = tls_channel(&cp, &ca, agent, "edge-01-again").await?;
    let (_up, other_id) = connect(channel, None, "edge-02", "a").await?;
    let status = other_id.expect_err("edge-01's certificate opened edge-02's stream");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(status.message().contains("edge-02"), "{status:?}");

    // A certificate from another CA fails the handshake: no call gets through.
    let stranger = other.leaf(&[], &["ferry://admin/mallory"])?;
    let refused = match tls_channel(&cp, &ca, Some(stranger), "mallory").await {
        Ok(channel) => call(channel, LIST_CONFIGS, None).await,
        Err(error) => Err(tonic::Status::unavailable(error.to_string())),
    };
    let status = refused.expect_err("a certificate from another CA was accepted");
    assert!(
        !matches!(status.code(), Code::Ok | Code::PermissionDenied),
        "{status:?}"
    );

    // TLS without a client certificate or token: no credential.
    let anonymous = tls_channel(&cp, &ca, None, "anonymous").await?;
    let status = call(anonymous, LIST_CONFIGS, None)
        .await
        .expect_err("anonymous");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    // A certificate of the right CA that names nobody.
    let nameless =
        tls_channel(&cp, &ca, Some(ca.leaf(&["host.example"], &[])?), "nameless").await?;
    let status = call(nameless, LIST_CONFIGS, None)
        .await
        .expect_err("nameless");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("ferry://"), "{status:?}");
    Ok(())
}
