//! Keyset paging shared by every listing: a request names a page size and
//! the opaque token of the previous page; the token encodes where the last
//! page ended (never an offset, so concurrent writes do not skip or repeat
//! rows) and which listing it belongs to.

use serde::{Deserialize, Serialize};

use super::error::{StateError, StateResult};

pub use ferry_shared::dlq::{DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE};

/// Which page of a listing to return.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageRequest {
    /// Maximum items; 0 means [`DEFAULT_PAGE_SIZE`], above
    /// [`MAX_PAGE_SIZE`] is lowered to it.
    pub size: u32,
    /// The previous page's `next_token`; `None` for the first page.
    pub token: Option<String>,
}

impl PageRequest {
    /// The first page with this size.
    pub fn first(size: u32) -> Self {
        Self { size, token: None }
    }

    /// The page after `page`, with the same size; `None` when `page` was the
    /// last.
    pub fn after<T>(&self, page: &Page<T>) -> Option<Self> {
        page.next_token.as_ref().map(|token| Self {
            size: self.size,
            token: Some(token.clone()),
        })
    }

    /// The effective page size.
    pub(crate) fn limit(&self) -> usize {
        ferry_shared::dlq::page_size(self.size) as usize
    }

    /// How many rows to fetch: one more than the page, to know whether
    /// another page follows.
    pub(crate) fn fetch_limit(&self) -> i64 {
        self.limit() as i64 + 1
    }

    /// The decoded cursor of a listing of `kind`, if this is not the first
    /// page.
    pub(crate) fn cursor(&self, kind: &str) -> StateResult<Option<Cursor>> {
        self.token
            .as_deref()
            .filter(|token| !token.is_empty())
            .map(|token| Cursor::decode(kind, token))
            .transpose()
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page<T> {
    /// The items, in the listing's order.
    pub items: Vec<T>,
    /// The token of the next page; `None` when this is the last.
    pub next_token: Option<String>,
}

/// Where a page ended: the last item's sort key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Cursor {
    /// The listing the token belongs to.
    kind: String,
    /// Text part of the sort key (an id or key).
    pub(crate) text: String,
    /// Numeric part of the sort key (a version or time).
    pub(crate) number: i64,
}

impl Cursor {
    fn decode(kind: &str, token: &str) -> StateResult<Self> {
        let invalid = || StateError::invalid("malformed page token");
        if !token.len().is_multiple_of(2) || !token.is_ascii() {
            return Err(invalid());
        }
        let bytes = (0..token.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&token[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| invalid())?;
        let cursor: Cursor = serde_json::from_slice(&bytes).map_err(|_| invalid())?;
        if cursor.kind != kind {
            return Err(StateError::invalid(
                "the page token belongs to another listing",
            ));
        }
        Ok(cursor)
    }

    fn encode(&self) -> String {
        // Serializing a struct of strings and integers cannot fail.
        let json = serde_json::to_vec(self).unwrap_or_default();
        json.iter().map(|byte| format!("{byte:02x}")).collect()
    }
}

/// Cuts `rows` (fetched with [`PageRequest::fetch_limit`]) to a page, with a
/// token made from the last item's sort key when more rows follow.
pub(crate) fn paginate<T>(
    request: &PageRequest,
    kind: &str,
    mut rows: Vec<T>,
    sort_key: impl Fn(&T) -> (String, i64),
) -> Page<T> {
    let limit = request.limit();
    if rows.len() <= limit {
        return Page {
            items: rows,
            next_token: None,
        };
    }
    rows.truncate(limit);
    let next_token = rows.last().map(|last| {
        let (text, number) = sort_key(last);
        Cursor {
            kind: kind.to_owned(),
            text,
            number,
        }
        .encode()
    });
    Page {
        items: rows,
        next_token,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_are_checked() {
        let request = PageRequest::first(2);
        let page = paginate(&request, "configs", vec![1, 2, 3], |n| {
            (format!("b{n}"), *n)
        });
        assert_eq!(page.items, vec![1, 2]);
        let next = request.after(&page).unwrap();
        let cursor = next.cursor("configs").unwrap().unwrap();
        assert_eq!((cursor.text.as_str(), cursor.number), ("b2", 2));
        assert!(matches!(next.cursor("leases"), Err(StateError::Invalid(_))));
        let bad = PageRequest {
            size: 1,
            token: Some("zz".into()),
        };
        assert!(matches!(bad.cursor("configs"), Err(StateError::Invalid(_))));
    }

    #[test]
    fn page_size_defaults_and_caps() {
        assert_eq!(PageRequest::first(0).limit(), 100);
        assert_eq!(PageRequest::first(5000).limit(), 1000);
    }
}
