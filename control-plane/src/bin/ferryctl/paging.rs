//! The one paging loop: every `ferry.v1` listing that ferryctl shows whole
//! (configurations, versions, agents, leases) pages with `page_token` and
//! `next_page_token`, and [`all_pages`] follows the tokens to the last page.

use std::future::Future;

use ferry_shared::api::v1 as pb;

/// A `List*Response`: one page of items and the token of the next page
/// (empty after the last).
pub trait Page {
    /// What the listing lists.
    type Item;
    /// The page's items and the next page's token.
    fn into_parts(self) -> (Vec<Self::Item>, String);
}

/// Every item of a listing, from the first page to the last. `fetch` makes
/// the call for one page token (empty for the first page).
///
/// A server that answers a token with the same token again would make this
/// loop forever; that is refused as an error instead.
pub async fn all_pages<P, F, Fut>(mut fetch: F) -> anyhow::Result<Vec<P::Item>>
where
    P: Page,
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<tonic::Response<P>, tonic::Status>>,
{
    let mut items = Vec::new();
    let mut page_token = String::new();
    loop {
        let (page, next) = fetch(page_token.clone()).await?.into_inner().into_parts();
        items.extend(page);
        if next.is_empty() {
            return Ok(items);
        }
        anyhow::ensure!(
            next != page_token,
            "the control plane returned page token {next:?} twice; the listing does not advance"
        );
        page_token = next;
    }
}

impl Page for pb::ListConfigsResponse {
    type Item = pb::BridgeConfig;
    fn into_parts(self) -> (Vec<Self::Item>, String) {
        (self.configs, self.next_page_token)
    }
}

impl Page for pb::ListConfigVersionsResponse {
    type Item = pb::ConfigVersion;
    fn into_parts(self) -> (Vec<Self::Item>, String) {
        (self.versions, self.next_page_token)
    }
}

impl Page for pb::ListAgentsResponse {
    type Item = pb::AgentInfo;
    fn into_parts(self) -> (Vec<Self::Item>, String) {
        (self.agents, self.next_page_token)
    }
}

impl Page for pb::ListLeasesResponse {
    type Item = pb::Lease;
    fn into_parts(self) -> (Vec<Self::Item>, String) {
        (self.leases, self.next_page_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing of `keys` served `per_page` at a time, the next token being
    /// the index of the next item (as an opaque string).
    fn page(keys: &[&str], per_page: usize, token: &str) -> pb::ListLeasesResponse {
        let start: usize = if token.is_empty() {
            0
        } else {
            token.parse().expect("a token this server made")
        };
        let end = (start + per_page).min(keys.len());
        pb::ListLeasesResponse {
            leases: keys[start..end]
                .iter()
                .map(|k| pb::Lease {
                    key: (*k).to_owned(),
                    ..Default::default()
                })
                .collect(),
            next_page_token: if end < keys.len() {
                end.to_string()
            } else {
                String::new()
            },
        }
    }

    #[tokio::test]
    async fn follows_tokens_to_the_last_page() {
        let keys = ["a", "b", "c", "d", "e", "f", "g"];
        let mut tokens = Vec::new();
        let listed = all_pages(|token| {
            tokens.push(token.clone());
            let response = page(&keys, 3, &token);
            async move { Ok(tonic::Response::new(response)) }
        })
        .await
        .expect("listed");
        let listed: Vec<String> = listed.into_iter().map(|l| l.key).collect();
        assert_eq!(listed, keys);
        assert_eq!(tokens, ["", "3", "6"]);
    }

    #[tokio::test]
    async fn an_empty_listing_is_one_call() {
        let mut calls = 0;
        let listed = all_pages(|token| {
            calls += 1;
            let response = page(&[], 3, &token);
            async move { Ok(tonic::Response::new(response)) }
        })
        .await
        .expect("listed");
        assert!(listed.is_empty());
        assert_eq!(calls, 1);
    }

    #[tokio::test]
    async fn a_failed_page_fails_the_listing() {
        let keys = ["a", "b", "c", "d"];
        let result = all_pages(|token| {
            let response = if token.is_empty() {
                Ok(tonic::Response::new(page(&keys, 2, &token)))
            } else {
                Err(tonic::Status::unavailable("state store unreachable"))
            };
            async move { response }
        })
        .await;
        let error = result.expect_err("the second page failed");
        let status = error.downcast_ref::<tonic::Status>().expect("a status");
        assert_eq!(status.code(), tonic::Code::Unavailable);
    }

    #[tokio::test]
    async fn a_token_that_does_not_advance_is_refused() {
        let result = all_pages(|_| async {
            Ok(tonic::Response::new(pb::ListLeasesResponse {
                leases: Vec::new(),
                next_page_token: "again".into(),
            }))
        })
        .await;
        let error = result.expect_err("refused");
        assert!(error.to_string().contains("\"again\" twice"), "{error}");
    }
}
