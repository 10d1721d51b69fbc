//! What the engine and Peer services share: the token check ([`same_token`]), how `Debug`
//! shows a token ([`Redacted`]), and the statuses both promise for requests their handlers
//! never see: tonic's codec answers OUT_OF_RANGE for a message over the size limit and INTERNAL for a body that does
//! not decode, where the protos (and gRPC for the first) say RESOURCE_EXHAUSTED and
//! INVALID_ARGUMENT. [`AsPromised`] rewrites those two in the headers of a trailers-only
//! response (how tonic answers a refused unary request). No handler of either service answers
//! OUT_OF_RANGE itself, and their INTERNAL messages never start with prost's decode-error
//! text. A `Session` stream's messages are decoded inside its handler, which maps them with
//! [`inbound`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use tonic::codegen::http;
use tonic::{Code, Status};

/// How prost's `DecodeError` displays itself (tonic passes it on as INTERNAL).
const DECODE_ERROR: &str = "failed to decode Protobuf message";

/// The status a refused inbound message should carry, if tonic's is not it.
pub(crate) fn promised(s: &Status) -> Option<Status> {
    match s.code() {
        Code::OutOfRange => Some(Status::resource_exhausted(s.message().to_owned())),
        Code::Internal if s.message().starts_with(DECODE_ERROR) => Some(Status::invalid_argument(
            format!("the request body is not a valid message: {}", s.message()),
        )),
        _ => None,
    }
}

/// A stream's inbound message that failed to arrive, as the client should see it.
pub(crate) fn inbound(method: &str, s: Status) -> Status {
    let s = promised(&s).unwrap_or(s);
    Status::new(s.code(), format!("{method}: {}", s.message()))
}

/// Wraps a tonic service so that its codec's refusals carry the promised statuses.
#[derive(Clone)]
pub(crate) struct AsPromised<S>(pub S);

impl<S, B> tonic::codegen::Service<http::Request<tonic::body::Body>> for AsPromised<S>
where
    S: tonic::codegen::Service<http::Request<tonic::body::Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let fut = self.0.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            if let Some(fixed) = Status::from_header_map(resp.headers()).and_then(|s| promised(&s))
            {
                // Only fails for a message that cannot be a header value; tonic's stays then.
                let _ = fixed.add_header(resp.headers_mut());
            }
            Ok(resp)
        })
    }
}

/// Compares without stopping at the first differing byte, so response time does not tell
/// how much of a guessed token was right.
pub(crate) fn same_token(expected: &[u8], got: &[u8]) -> bool {
    expected.len() == got.len()
        && expected
            .iter()
            .zip(got)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// A token as `Debug` shows it: `""` where none is set (so "not checked" stays visible),
/// else `<redacted>`.
pub(crate) struct Redacted<'a>(pub(crate) &'a str);

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("\"\"")
        } else {
            f.write_str("<redacted>")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_a_token() {
        assert_eq!(format!("{:?}", Redacted("s3cr3t")), "<redacted>");
        assert_eq!(format!("{:?}", Redacted("")), "\"\"");
        let peers = crate::peer::GrpcPeersConfig {
            node_id: "a".into(),
            provider: crate::peer::Provider::Tcp,
            token: "s3cr3t".into(),
            peers: vec![("b".into(), "127.0.0.1:1".into())],
            shm_dir: "/tmp".into(),
            data_listen: "127.0.0.1:0".into(),
            data_lanes: 2,
        };
        for text in [format!("{peers:?}"), format!("{peers:#?}")] {
            assert!(
                !text.contains("s3cr3t") && text.contains("<redacted>"),
                "{text}"
            );
            assert!(text.contains("127.0.0.1:1"), "{text}");
        }
        let req = crate::service::engine::fd_socket::parse("memfd eng 1 0 4096 s3cr3t").unwrap();
        let text = format!("{req:?}");
        assert!(
            !text.contains("s3cr3t") && text.contains("<redacted>"),
            "{text}"
        );
    }

    #[test]
    fn codec_refusals_are_mapped_and_handler_statuses_kept() {
        let big = Status::out_of_range("decoded message length too large");
        assert_eq!(promised(&big).unwrap().code(), Code::ResourceExhausted);
        let garbled = Status::internal("failed to decode Protobuf message: invalid wire type");
        let s = inbound("Session", garbled);
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(
            s.message().starts_with("Session: the request body"),
            "{s:?}"
        );
        assert!(promised(&Status::internal("Load: a transfer failed")).is_none());
        assert!(promised(&Status::not_found("x")).is_none());
        assert_eq!(
            inbound("S", Status::cancelled("gone")).code(),
            Code::Cancelled
        );
    }
}
