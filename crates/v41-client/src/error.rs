//! The client's error type.

/// What can go wrong talking to a v41 server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address is malformed or the server cannot be reached.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The server answered with a gRPC status (INVALID_ARGUMENT, UNAVAILABLE, ...).
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// The server broke the protocol (e.g. a stream that ended without its `Complete`).
    #[error("protocol error: {0}")]
    Protocol(String),
}
