//! Build-time code generation for Ibex: tonic's generated gRPC clients and servers, with
//! their unary calls on Ibex's direct path.
//!
//! tonic's `Grpc::unary` builds, for every call, an encoder body, a streaming decoder,
//! compression state and status header maps. Over Ibex a unary request and its answer are
//! each one packet, so `ibex_transport::grpc` can decode and encode the protobuf message
//! itself and skip all of that (see `transport/src/grpc/direct.rs`). This crate wraps
//! tonic-prost-build's generator so that the code it writes takes that path:
//!
//! - a generated client over an Ibex `Channel` makes its unary calls directly; over any
//!   other channel (stock tonic, an interceptor, `http://`) it is tonic's client, unchanged;
//! - a generated server's unary routes decode a request that came whole over Ibex
//!   themselves, and leave everything else (stock HTTP/2, compression, several messages)
//!   to tonic; on an Ibex server each route also offers itself as a direct route, which
//!   the server then calls with no `http::Request`, router or response body in between
//!   (only when the service was added as generated, not behind a wrapper).
//!
//! The types and their APIs are tonic's own, so user code does not change; only `build.rs`:
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let fds = prost_types::FileDescriptorSet::default();
//! let mut config = prost_build::Config::new();
//! config.bytes(["."]);
//! config.service_generator(ibex_codegen::direct(
//!     tonic_prost_build::configure().build_transport(false).service_generator(),
//! ));
//! config.compile_fds(fds)?;
//! # Ok(()) }
//! ```
//!
//! The crate that includes the generated code must depend on `ibex-transport` (feature
//! `grpc`, the default). The wrapper edits tonic-prost-build 0.14's output at a few fixed
//! places; if a tonic release moves one, the build fails and names it rather than
//! generating code that silently skips the direct path.

use prost_build::{Service, ServiceGenerator};

/// Wraps tonic-prost-build's service generator (`Builder::service_generator()`) so that
/// the unary methods it generates go through Ibex's direct path.
pub fn direct(tonic: Box<dyn ServiceGenerator>) -> Box<dyn ServiceGenerator> {
    Box::new(Direct { tonic })
}

struct Direct {
    tonic: Box<dyn ServiceGenerator>,
}

impl ServiceGenerator for Direct {
    fn generate(&mut self, service: Service, buf: &mut String) {
        let start = buf.len();
        let name = service.name.clone();
        let unary = service
            .methods
            .iter()
            .filter(|m| !m.client_streaming && !m.server_streaming)
            .count();
        self.tonic.generate(service, buf);
        match rewrite(&buf[start..], &name, unary) {
            Ok(code) => buf.replace_range(start.., &code),
            // A build script reports by failing; the message names what moved.
            Err(e) => panic!(
                "ibex-codegen: service {name}: {e}. ibex-codegen edits tonic-prost-build 0.14's \
                 output; build with the tonic-prost-build version in Cargo.lock, or use \
                 tonic_prost_build directly (no direct path)"
            ),
        }
    }

    fn finalize(&mut self, buf: &mut String) {
        self.tonic.finalize(buf);
    }

    fn finalize_package(&mut self, package: &str, buf: &mut String) {
        self.tonic.finalize_package(package, buf);
    }
}

/// tonic's code for service `name` (with `unary` unary methods), edited for the direct path.
fn rewrite(code: &str, name: &str, unary: usize) -> Result<String, String> {
    // tonic writes the client's module, then the server's.
    let split = match code.find(&format!("pub struct {name}Server<T")) {
        Some(at) => code[..at].rfind("pub mod ").unwrap_or(0),
        None => code.len(),
    };
    let (client_code, server_code) = code.split_at(split);
    let mut out = if client_code.contains(&format!("pub struct {name}Client<T>")) {
        client(client_code.to_string(), name, unary)?
    } else {
        client_code.to_string()
    };
    if server_code.is_empty() {
        return Ok(out);
    }
    out.push_str(&server(server_code, unary)?);
    Ok(out)
}

/// Each unary route answers through `serve_unary`, and its method type (`EchoSvc<T>`, a
/// handle on the service) becomes `Clone`, so that the route can offer itself to the Ibex
/// server as a direct route. `Self` (the generated server type) tells the server that the
/// route is the service it was given, not one behind a wrapper.
fn server(code: &str, unary: usize) -> Result<String, String> {
    const CALL: &str = "grpc.unary(method, req).await";
    let mut code = replace(
        code,
        CALL,
        "::ibex_transport::grpc::serve_unary::<Self, _, _, _>(&mut grpc, method, req, \
         max_decoding_message_size, max_encoding_message_size).await",
        unary,
    )?;
    const SERVE: &str = "::ibex_transport::grpc::serve_unary::<Self";
    let calls: Vec<usize> = code.match_indices(SERVE).map(|(i, _)| i).collect();
    for &at in calls.iter().rev() {
        // `struct EchoSvc<T: Echo>(pub Arc<T>);`, the route's method type.
        let def = code[..at]
            .rfind("struct ")
            .ok_or("a unary route without its method struct")?;
        let end = code[def..at]
            .find(';')
            .map(|i| def + i)
            .ok_or("an unterminated method struct")?;
        let text = &code[def + "struct ".len()..end];
        let (name, bound) = text
            .strip_suffix(">(pub Arc<T>)")
            .and_then(|t| t.split_once("<T: "))
            .ok_or_else(|| {
                format!("a unary route's method struct is not `struct NameSvc<T: Trait>(pub Arc<T>)`: `{text}`")
            })?;
        let clone = format!(
            "\n                    impl<T: {bound}> Clone for {name}<T> {{\n                        \
             fn clone(&self) -> Self {{\n                            Self(Arc::clone(&self.0))\n                        \
             }}\n                    }}"
        );
        code.insert_str(end + 1, &clone);
    }
    Ok(code)
}

fn client(code: String, name: &str, unary: usize) -> Result<String, String> {
    const DIRECT: &str = "::ibex_transport::grpc::DirectClient";
    let mut code = code;
    for (from, to, n) in [
        (
            "inner: tonic::client::Grpc<T>,".to_string(),
            format!("inner: tonic::client::Grpc<T>,\n        direct: Option<{DIRECT}>,"),
            1,
        ),
        // Telling an Ibex channel apart takes `Any`.
        (
            format!("impl<T> {name}Client<T>\n    where\n"),
            format!("impl<T> {name}Client<T>\n    where\n        T: 'static,\n"),
            1,
        ),
        (
            "F: tonic::service::Interceptor,".into(),
            "F: tonic::service::Interceptor + 'static,".into(),
            1,
        ),
        (
            "let inner = tonic::client::Grpc::new(inner);".into(),
            format!("let direct = {DIRECT}::of(&inner);\n            let inner = tonic::client::Grpc::new(inner);"),
            1,
        ),
        (
            "let inner = tonic::client::Grpc::with_origin(inner, origin);".into(),
            format!("let direct = {DIRECT}::of(&inner);\n            let inner = tonic::client::Grpc::with_origin(inner, origin);"),
            1,
        ),
        ("Self { inner }".into(), "Self { inner, direct }".into(), 2),
        // The direct path sends and accepts plain messages only.
        (
            "self.inner = self.inner.send_compressed(encoding);".into(),
            "self.inner = self.inner.send_compressed(encoding);\n            self.direct = None;".into(),
            1,
        ),
        (
            "self.inner = self.inner.accept_compressed(encoding);".into(),
            "self.inner = self.inner.accept_compressed(encoding);\n            self.direct = None;".into(),
            1,
        ),
        (
            "self.inner = self.inner.max_decoding_message_size(limit);".into(),
            "self.inner = self.inner.max_decoding_message_size(limit);\n            \
             if let Some(d) = &mut self.direct {\n                d.max_decoding_message_size(limit);\n            }"
                .into(),
            1,
        ),
        (
            "self.inner = self.inner.max_encoding_message_size(limit);".into(),
            "self.inner = self.inner.max_encoding_message_size(limit);\n            \
             if let Some(d) = &mut self.direct {\n                d.max_encoding_message_size(limit);\n            }"
                .into(),
            1,
        ),
    ] {
        code = replace(&code, &from, &to, n)?;
    }
    // Each unary method answers from the direct path first, before tonic's readiness
    // check and method extension, which the direct path does not use. Its path is parsed
    // once (`from_static` checks every byte, about 230 instructions a call).
    const CALL: &str = "self.inner.unary(req, path, codec).await";
    let calls: Vec<usize> = code.match_indices(CALL).map(|(i, _)| i).collect();
    if calls.len() != unary {
        return Err(format!(
            "expected {unary} unary client calls (`{CALL}`), found {}",
            calls.len()
        ));
    }
    for &at in calls.iter().rev() {
        let fn_at = code[..at]
            .rfind("pub async fn ")
            .ok_or("a unary call outside a client method")?;
        // `from_static(` and the literal, which the formatter may put on its own line.
        const PATH: &str = "PathAndQuery::from_static(";
        let p = code[fn_at..at]
            .find(PATH)
            .map(|i| fn_at + i + PATH.len())
            .and_then(|p| code[p..at].find('"').map(|i| p + i + 1))
            .ok_or("a unary client method without a static path")?;
        let path_end = code[p..]
            .find('"')
            .map(|i| p + i)
            .ok_or("an unterminated method path")?;
        let path = code[p..path_end].to_string();
        let ret = code[fn_at..at]
            .find(") -> ")
            .map(|i| fn_at + i)
            .ok_or("a unary client method without a return type")?;
        let open = code[ret..at]
            .find('{')
            .map(|i| ret + i + 1)
            .ok_or("a unary client method without a body")?;
        code.insert_str(
            open,
            &format!(
                "\n            if let Some(d) = &self.direct {{\n                \
                 static PATH: ::std::sync::LazyLock<http::uri::PathAndQuery> = \
                 ::std::sync::LazyLock::new(|| http::uri::PathAndQuery::from_static(\"{path}\"));\n                \
                 return d.unary(request.into_request(), PATH.clone()).await;\n            }}"
            ),
        );
    }
    Ok(code)
}

/// `code` with each of the `n` occurrences of `from` replaced; any other count is an error.
fn replace(code: &str, from: &str, to: &str, n: usize) -> Result<String, String> {
    let found = code.matches(from).count();
    if found != n {
        return Err(format!(
            "expected `{from}` {n} time(s), found it {found} time(s)"
        ));
    }
    Ok(code.replace(from, to))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_build::{Comments, Method};

    fn method(name: &str, client_streaming: bool, server_streaming: bool) -> Method {
        Method {
            name: name.to_lowercase(),
            proto_name: name.into(),
            comments: Comments::default(),
            input_type: "super::Req".into(),
            output_type: "super::Resp".into(),
            input_proto_type: ".pkg.Req".into(),
            output_proto_type: ".pkg.Resp".into(),
            options: Default::default(),
            client_streaming,
            server_streaming,
        }
    }

    fn service(package: &str, methods: Vec<Method>) -> Service {
        Service {
            name: "Svc".into(),
            proto_name: "Svc".into(),
            package: package.into(),
            comments: Comments::default(),
            methods,
            options: Default::default(),
        }
    }

    /// tonic-prost-build's real output for `svc`, through the wrapper.
    fn generate(svc: Service, client: bool, server: bool) -> String {
        let tonic = tonic_prost_build::configure()
            .build_client(client)
            .build_server(server)
            .build_transport(false)
            .service_generator();
        let mut buf = String::new();
        direct(tonic).generate(svc, &mut buf);
        buf
    }

    #[test]
    fn every_unary_method_and_route_takes_the_direct_path() {
        let methods = vec![
            method("One", false, false),
            method("Two", false, false),
            method("Up", true, false),
            method("Down", false, true),
            method("Both", true, true),
        ];
        let code = generate(service("pkg.v1", methods), true, true);
        assert_eq!(
            code.matches("DirectClient::of(&inner)").count(),
            2,
            "new, with_origin"
        );
        assert_eq!(code.matches("return d").count(), 2, "{code}");
        assert!(code.contains("from_static(\"/pkg.v1.Svc/One\")"), "{code}");
        assert!(code.contains("from_static(\"/pkg.v1.Svc/Two\")"), "{code}");
        assert_eq!(
            code.matches("::ibex_transport::grpc::serve_unary::<Self, _, _, _>(")
                .count(),
            2
        );
        assert!(code.contains("impl<T: Svc> Clone for OneSvc<T>"), "{code}");
        assert!(code.contains("impl<T: Svc> Clone for TwoSvc<T>"), "{code}");
        assert!(!code.contains("Clone for UpSvc"), "{code}");
        // Streaming calls stay tonic's.
        assert!(code.contains("self.inner.streaming("), "{code}");
        assert!(code.contains("grpc.server_streaming("), "{code}");
    }

    #[test]
    fn services_without_unary_methods_or_without_a_side_still_generate() {
        let stream_only = vec![method("Down", false, true), method("Up", true, false)];
        let code = generate(service("", stream_only), true, true);
        assert!(
            !code.contains("serve_unary") && !code.contains("return d"),
            "{code}"
        );
        assert!(code.contains("direct: Option<"), "{code}");
        let code = generate(service("p", vec![method("One", false, false)]), false, true);
        assert_eq!(code.matches("serve_unary").count(), 1, "{code}");
        let code = generate(service("p", vec![method("One", false, false)]), true, false);
        assert!(code.contains("from_static(\"/p.Svc/One\")"), "{code}");
        assert!(!code.contains("serve_unary"), "{code}");
    }

    #[test]
    fn a_moved_anchor_is_named() {
        let e = rewrite("pub struct EchoClient<T> { other: u8 }", "Echo", 1).unwrap_err();
        assert!(e.contains("inner: tonic::client::Grpc<T>,"), "{e}");
        let e = rewrite(
            "pub struct EchoServer<T> { inner: Arc<T> } grpc.unary(method, req).await",
            "Echo",
            2,
        )
        .unwrap_err();
        assert!(e.contains("found it 1 time(s)"), "{e}");
    }
}
