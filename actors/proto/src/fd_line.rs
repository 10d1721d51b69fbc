//! The fd socket's answer line: a descriptor the client sends (SCM_RIGHTS, one line naming
//! it) is answered with `ok <handle>` or `err <code> <message>`, the code a gRPC status
//! code written as a kebab-case word that both sides must read alike.

use tonic::Code;

/// The answer line's code word: `InvalidArgument` → `invalid-argument`.
pub fn code_name(code: Code) -> String {
    let mut out = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The code word back to a code (client side).
pub fn code_from_name(name: &str) -> Code {
    [
        Code::InvalidArgument,
        Code::NotFound,
        Code::PermissionDenied,
        Code::Unauthenticated,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Unavailable,
        Code::Internal,
    ]
    .into_iter()
    .find(|c| code_name(*c) == name)
    .unwrap_or(Code::Unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_words_round_trip() {
        assert_eq!(code_name(Code::InvalidArgument), "invalid-argument");
        assert_eq!(
            code_from_name("resource-exhausted"),
            Code::ResourceExhausted
        );
        assert_eq!(code_from_name("no-such-code"), Code::Unknown);
    }
}
