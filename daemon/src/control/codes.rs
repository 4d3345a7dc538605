//! The one map from a data-plane error code to a gRPC status code.

use packd_proto::v1::ErrorCode;
use tonic::Code;

/// Maps a data-plane error code to a gRPC status code.
pub fn grpc_code(code: ErrorCode) -> Code {
    match code {
        ErrorCode::InvalidArgument | ErrorCode::BadSource | ErrorCode::BadFd => Code::InvalidArgument,
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::ResourceExhausted => Code::ResourceExhausted,
        ErrorCode::PermissionDenied => Code::PermissionDenied,
        ErrorCode::AlreadyExists => Code::AlreadyExists,
        ErrorCode::FrameTooLarge | ErrorCode::MalformedFrame => Code::InvalidArgument,
        ErrorCode::Internal | ErrorCode::Unspecified => Code::Internal,
    }
}
