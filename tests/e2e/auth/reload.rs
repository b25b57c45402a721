//! The token file changes while the control plane runs: the new token works,
//! the removed one is refused, and a broken file keeps the tokens in force.

use tonic::Code;

use super::support::{Server, TIMEOUT, call, write_tokens};

const LIST_CONFIGS: &str = "/ferry.v1.ConfigService/ListConfigs";

#[tokio::test]
async fn a_changed_token_file_takes_effect_without_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.yaml");
    write_tokens(&tokens, &[("old", "viewer", None, "old-token")])?;
    let flags = ["--tokens".to_owned(), tokens.display().to_string()];
    let mut cp = Server::control_plane(dir, &flags).await?;
    call(cp.channel().await?, LIST_CONFIGS, Some("old-token"))
        .await
        .map_err(|s| anyhow::anyhow!("{s:?}"))?;

    write_tokens(&tokens, &[("new", "viewer", None, "new-token")])?;
    let channel = cp.channel().await?;
    ferry_tests::wait::until(TIMEOUT, "the new token accepted", || {
        let channel = channel.clone();
        async move { call(channel, LIST_CONFIGS, Some("new-token")).await.is_ok() }
    })
    .await?;
    let status = call(cp.channel().await?, LIST_CONFIGS, Some("old-token"))
        .await
        .expect_err("the removed token still works");
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().contains("not in the server's token file"),
        "{status:?}"
    );

    let partial = tokens.with_extension("partial");
    std::fs::write(&partial, "tokens: [")?;
    std::fs::rename(&partial, &tokens)?;
    cp.process
        .wait_for_output("token file refused", TIMEOUT)
        .await?;
    call(cp.channel().await?, LIST_CONFIGS, Some("new-token"))
        .await
        .map_err(|s| anyhow::anyhow!("the tokens in force were dropped: {s:?}"))?;
    Ok(())
}
