//! What a hostile or broken client sends and the typed clients cannot: message bodies of
//! arbitrary bytes on any gRPC method, and more descriptors on a Unix socket than one
//! request may carry.

use std::os::fd::RawFd;

use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Code, Status};

/// Messages as raw bytes, both ways.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawCodec;

#[derive(Debug)]
pub struct RawEncoder;

#[derive(Debug)]
pub struct RawDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        prost::bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        use prost::bytes::Buf;
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }
}

/// Field 1 as a varint where every request's field 1 is a string, then a truncated length:
/// no message of either service decodes from it.
pub const GARBLED: &[u8] = &[0x08, 0x01, 0x12, 0xff];

async fn grpc(addr: &str) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("an address")
        .connect()
        .await
        .expect("the service is up");
    tonic::client::Grpc::new(channel)
}

fn request<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("an ASCII token"),
    );
    r
}

/// Calls unary `path` (e.g. `/kvferry.v1.Engine/Query`) on `addr` with `body` as the
/// message; returns the answer's status code (OK for an answer).
pub async fn unary_code(addr: &str, token: &str, path: &'static str, body: Vec<u8>) -> Code {
    let mut g = grpc(addr).await;
    g.ready().await.expect("ready");
    match g
        .unary(
            request(body, token),
            PathAndQuery::from_static(path),
            RawCodec,
        )
        .await
    {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Opens the client stream `path` on `addr`, sends `body` as its one message and keeps the
/// stream open; returns how the response stream ends: its first error's status, or OK.
pub async fn stream_end(addr: &str, token: &str, path: &'static str, body: Vec<u8>) -> Status {
    let mut g = grpc(addr).await;
    g.ready().await.expect("ready");
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(body).await.expect("queued");
    let outbound = tonic::codegen::tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut inbound = match g
        .streaming(
            request(outbound, token),
            PathAndQuery::from_static(path),
            RawCodec,
        )
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) => return s,
    };
    loop {
        match inbound.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => return Status::ok(""),
            Err(s) => {
                drop(tx);
                return s;
            }
        }
    }
}

/// Sends `data` with every one of `fds` attached in one `sendmsg` (the kernel takes up to
/// 253), unlike `fd_passing::send_with_fds`, which refuses more than a request may carry.
pub fn send_many_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: a zeroed msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds `space` zeroed, aligned bytes: one header and its
    // `fds.len()` descriptors; msg points at live buffers during sendmsg.
    let r = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
        std::ptr::copy_nonoverlapping(
            fds.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(cmsg),
            fd_bytes as usize,
        );
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
