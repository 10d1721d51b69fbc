//! The engine service (`kvferry.v1.Engine`) over a `Node`: the gRPC server
//! ([`server::serve`]), client memory arriving on the [`fd_socket::FdSocket`], the handles it
//! becomes ([`memory_handles`]), request mailboxes served by node threads (`mailbox`),
//! requests checked and turned into the node's (`request`), and completions ([`completions`]).

pub mod completions;
pub mod fd_socket;
mod info;
mod load;
pub(crate) mod mailbox;
pub mod memory_handles;
mod registration;
mod request;
mod save;
pub mod server;
mod service;
mod session;
mod shared;

pub use fd_socket::FdSocket;
pub use server::{serve, EngineOptions, EngineServeError};
