//! Build-time code generation for Ibex: tonic's generated gRPC clients and servers, plus,
//! for each service, a module of Ibex types with the same API whose unary methods take
//! Ibex's direct path.
//!
//! tonic's `Grpc::unary` builds, for every call, an encoder body, a streaming decoder,
//! compression state and status header maps. Over Ibex a unary request and its answer are
//! each one packet, so `ibex_transport::grpc` can decode and encode the protobuf message
//! itself and skip all of that. For a service `Echo` the generated code holds tonic's
//! `echo_server` and `echo_client` modules, exactly as tonic-prost-build writes them, and
//! beside them `echo_ibex`, generated here from the same service description:
//!
//! - `echo_ibex::EchoServer`, added with `ibex_transport::grpc::Server::builder()
//!   .add_service(..)`, registers each unary method as a direct handler when it is added;
//!   its other methods, and what the direct path does not take (compression, a request in
//!   several messages), go to tonic's `echo_server::EchoServer` for the same service;
//! - `echo_ibex::EchoClient` over an Ibex `Channel` makes its unary calls directly, and
//!   everything else through tonic's `echo_client::EchoClient`;
//! - everything else of tonic's modules (the `Echo` trait, `SERVICE_NAME`) is re-exported,
//!   so switching a program to the direct path is a change of its `use` lines.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let fds = prost_types::FileDescriptorSet::default();
//! let mut config = prost_build::Config::new();
//! config.bytes(["."]);
//! config.service_generator(ibex_codegen::configure().service_generator());
//! config.compile_fds(fds)?;
//! # Ok(()) }
//! ```
//!
//! The crate that includes the generated code must depend on `ibex-transport` (feature
//! `grpc`, the default) and `tonic`.

use proc_macro2::TokenStream;
use prost_build::{Method, Service, ServiceGenerator};
use quote::{format_ident, quote};

/// A generator to configure: which sides to build, and tonic-prost-build's own settings.
pub fn configure() -> Builder {
    Builder {
        build_client: true,
        build_server: true,
        emit_package: true,
        tonic: Box::new(|b| b),
    }
}

/// The settings of [`configure`].
pub struct Builder {
    build_client: bool,
    build_server: bool,
    emit_package: bool,
    tonic: Box<dyn FnOnce(tonic_prost_build::Builder) -> tonic_prost_build::Builder>,
}

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder")
            .field("build_client", &self.build_client)
            .field("build_server", &self.build_server)
            .field("emit_package", &self.emit_package)
            .finish_non_exhaustive()
    }
}

impl Builder {
    /// Generate clients (default true), tonic's and Ibex's.
    pub fn build_client(mut self, enable: bool) -> Self {
        self.build_client = enable;
        self
    }

    /// Generate servers (default true), tonic's and Ibex's.
    pub fn build_server(mut self, enable: bool) -> Self {
        self.build_server = enable;
        self
    }

    /// Put the package name in method paths (default true), as tonic-prost-build's
    /// setting of the same name.
    pub fn emit_package(mut self, enable: bool) -> Self {
        self.emit_package = enable;
        self
    }

    /// Any other tonic-prost-build setting (attributes, codec, comments), applied to the
    /// builder that generates tonic's modules. The sides and the package setting are this
    /// builder's, set after `f` runs; tonic's own `connect` helpers (tied to tonic's
    /// transport) are replaced by ones that connect over Ibex.
    pub fn with_tonic(
        mut self,
        f: impl FnOnce(tonic_prost_build::Builder) -> tonic_prost_build::Builder + 'static,
    ) -> Self {
        self.tonic = Box::new(f);
        self
    }

    /// The service generator for `prost_build::Config::service_generator`.
    pub fn service_generator(self) -> Box<dyn ServiceGenerator> {
        let tonic = (self.tonic)(tonic_prost_build::configure())
            .build_client(self.build_client)
            .build_server(self.build_server)
            .build_transport(false)
            .emit_package(self.emit_package)
            .service_generator();
        Box::new(Generator {
            tonic,
            client: self.build_client,
            server: self.build_server,
            emit_package: self.emit_package,
        })
    }
}

struct Generator {
    tonic: Box<dyn ServiceGenerator>,
    client: bool,
    server: bool,
    emit_package: bool,
}

impl ServiceGenerator for Generator {
    fn generate(&mut self, service: Service, buf: &mut String) {
        let ibex = ibex_module(&service, self.client, self.server, self.emit_package);
        self.tonic.generate(service, buf);
        if let Some(tokens) = ibex {
            buf.push_str(&render(tokens));
        }
    }

    fn finalize(&mut self, buf: &mut String) {
        self.tonic.finalize(buf);
    }

    fn finalize_package(&mut self, package: &str, buf: &mut String) {
        self.tonic.finalize_package(package, buf);
    }
}

/// Generated tokens as formatted source. The tokens come from this crate's templates, so
/// a failure is a bug here; a build script reports it by failing.
fn render(tokens: TokenStream) -> String {
    match syn::parse2::<syn::File>(tokens) {
        Ok(file) => prettyplease::unparse(&file),
        Err(e) => {
            panic!("ibex-codegen generated code that does not parse (an ibex-codegen bug): {e}")
        }
    }
}

/// tonic's module names: `EchoService` becomes `echo_service`.
fn snake_case(name: &str) -> String {
    let mut s = String::new();
    let mut it = name.chars().peekable();
    while let Some(c) = it.next() {
        s.push(c.to_ascii_lowercase());
        if it.peek().is_some_and(|n| n.is_uppercase()) {
            s.push('_');
        }
    }
    s
}

/// A message type as tonic names it from inside its modules.
fn message_type(ty: &str) -> TokenStream {
    if ty == "()" {
        return quote!(());
    }
    let path = if ty.starts_with("::") || ty.starts_with("crate::") {
        ty.to_string()
    } else {
        let parts: Vec<&str> = ty.split('.').filter(|p| !p.is_empty()).collect();
        format!("super::{}", parts.join("::"))
    };
    match syn::parse_str::<syn::Path>(&path) {
        Ok(p) => quote!(#p),
        Err(e) => panic!("ibex-codegen: message type `{ty}` is not a Rust path: {e}"),
    }
}

fn is_unary(m: &Method) -> bool {
    !m.client_streaming && !m.server_streaming
}

/// The `{service}_ibex` module, or `None` when neither side is built.
fn ibex_module(s: &Service, client: bool, server: bool, emit_package: bool) -> Option<TokenStream> {
    if !client && !server {
        return None;
    }
    let snake = snake_case(&s.name);
    let module = format_ident!("{}_ibex", snake);
    let service_name = if emit_package && !s.package.is_empty() {
        format!("{}.{}", s.package, s.proto_name)
    } else {
        s.proto_name.clone()
    };
    let doc = format!(
        " Ibex's direct path for `{service_name}`: tonic's types for this service, with the \
         unary methods of the server and the client below answered and called directly \
         over Ibex (generated by ibex-codegen)."
    );
    let server_items = server.then(|| server_items(s, &snake, &service_name));
    let client_items = client.then(|| client_items(s, &snake, &service_name));
    Some(quote! {
        #[doc = #doc]
        pub mod #module {
            #![allow(unused_imports, missing_docs, clippy::wildcard_imports, clippy::let_unit_value)]
            #server_items
            #client_items
        }
    })
}

fn server_items(s: &Service, snake: &str, service_name: &str) -> TokenStream {
    let tonic_mod = format_ident!("{}_server", snake);
    let server = format_ident!("{}Server", s.name);
    let service_trait = format_ident!("{}", s.name);
    let doc = format!(
        " tonic's `{snake}_server::{}` for Ibex: added to `ibex_transport::grpc::Server`, \
         each unary method is answered by its direct handler, and every other call by \
         tonic's server for the same service.",
        s.name
    );
    let routes = s.methods.iter().filter(|m| is_unary(m)).map(|m| {
        let path = format!("/{service_name}/{}", m.proto_name);
        let name = format_ident!("{}", m.name);
        let req = message_type(&m.input_type);
        let resp = message_type(&m.output_type);
        quote! {
            let inner = std::sync::Arc::clone(&service);
            services.add_unary(
                #path,
                ::ibex_transport::grpc::DirectRoute::unary(
                    move |request: tonic::Request<#req>| -> ::ibex_transport::grpc::UnaryFuture<#resp> {
                        let inner = std::sync::Arc::clone(&inner);
                        Box::pin(async move { <T as #service_trait>::#name(&inner, request).await })
                    },
                    max_decoding_message_size,
                    max_encoding_message_size,
                ),
            );
        }
    });
    quote! {
        pub use super::#tonic_mod::*;

        #[doc = #doc]
        #[derive(Debug)]
        pub struct #server<T> {
            inner: std::sync::Arc<T>,
            tonic: super::#tonic_mod::#server<T>,
            max_decoding_message_size: Option<usize>,
            max_encoding_message_size: Option<usize>,
        }

        impl<T> Clone for #server<T> {
            fn clone(&self) -> Self {
                Self {
                    inner: std::sync::Arc::clone(&self.inner),
                    tonic: self.tonic.clone(),
                    max_decoding_message_size: self.max_decoding_message_size,
                    max_encoding_message_size: self.max_encoding_message_size,
                }
            }
        }

        impl<T: #service_trait> #server<T> {
            pub fn new(inner: T) -> Self {
                Self::from_arc(std::sync::Arc::new(inner))
            }

            pub fn from_arc(inner: std::sync::Arc<T>) -> Self {
                Self {
                    tonic: super::#tonic_mod::#server::from_arc(std::sync::Arc::clone(&inner)),
                    inner,
                    max_decoding_message_size: None,
                    max_encoding_message_size: None,
                }
            }

            /// Accepts requests compressed with `encoding` (they take tonic's code).
            #[must_use]
            pub fn accept_compressed(mut self, encoding: tonic::codec::CompressionEncoding) -> Self {
                self.tonic = self.tonic.accept_compressed(encoding);
                self
            }

            /// Compresses responses with `encoding` for clients that accept it (their
            /// calls take tonic's code).
            #[must_use]
            pub fn send_compressed(mut self, encoding: tonic::codec::CompressionEncoding) -> Self {
                self.tonic = self.tonic.send_compressed(encoding);
                self
            }

            /// Limits the size of a decoded request message (default 4 MiB).
            #[must_use]
            pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
                self.tonic = self.tonic.max_decoding_message_size(limit);
                self.max_decoding_message_size = Some(limit);
                self
            }

            /// Limits the size of an encoded response message (default `usize::MAX`).
            #[must_use]
            pub fn max_encoding_message_size(mut self, limit: usize) -> Self {
                self.tonic = self.tonic.max_encoding_message_size(limit);
                self.max_encoding_message_size = Some(limit);
                self
            }

            /// tonic's server for the same service: for stock tonic's `Server`, or to put
            /// behind an interceptor or a tower layer (its calls then all take tonic's code).
            pub fn into_tonic(self) -> super::#tonic_mod::#server<T> {
                self.tonic
            }
        }

        impl<T: #service_trait> ::ibex_transport::grpc::AddService<::ibex_transport::grpc::Generated>
            for #server<T>
        {
            fn add_to(self, services: &mut ::ibex_transport::grpc::Services) {
                let Self {
                    inner: service,
                    tonic,
                    max_decoding_message_size,
                    max_encoding_message_size,
                } = self;
                services.add_tower(tonic);
                #(#routes)*
            }
        }
    }
}

fn client_items(s: &Service, snake: &str, service_name: &str) -> TokenStream {
    let tonic_mod = format_ident!("{}_client", snake);
    let client = format_ident!("{}Client", s.name);
    let doc = format!(
        " tonic's `{snake}_client::{}` over an Ibex channel: unary calls go directly, \
         everything else through tonic's client (over an `http://` channel, or once \
         compression is asked for, every call does).",
        s.name
    );
    let methods = s.methods.iter().map(|m| {
        let name = format_ident!("{}", m.name);
        let req = message_type(&m.input_type);
        let resp = message_type(&m.output_type);
        let path = format!("/{service_name}/{}", m.proto_name);
        let request = if m.client_streaming {
            quote!(impl tonic::IntoStreamingRequest<Message = #req>)
        } else {
            quote!(impl tonic::IntoRequest<#req>)
        };
        let response = if m.server_streaming {
            quote!(tonic::codec::Streaming<#resp>)
        } else {
            quote!(#resp)
        };
        let direct = is_unary(m).then(|| {
            quote! {
                if self.direct.active() {
                    // Parsed once: `from_static` checks every byte.
                    static PATH: std::sync::LazyLock<tonic::codegen::http::uri::PathAndQuery> =
                        std::sync::LazyLock::new(|| {
                            tonic::codegen::http::uri::PathAndQuery::from_static(#path)
                        });
                    return self.direct.unary(request.into_request(), PATH.clone()).await;
                }
            }
        });
        quote! {
            pub async fn #name(
                &mut self,
                request: #request,
            ) -> std::result::Result<tonic::Response<#response>, tonic::Status> {
                #direct
                self.tonic.#name(request).await
            }
        }
    });
    // tonic's generated `connect`, over an Ibex channel: on tonic's client type and on ours.
    let connect = quote! {
        /// Connects to `dst` (an Ibex address such as `tcp://host:port`, an `http://` one,
        /// or an `Endpoint`), as tonic's generated `connect`.
        pub async fn connect<D>(dst: D) -> std::result::Result<Self, ::ibex_transport::Error>
        where
            D: TryInto<::ibex_transport::grpc::Endpoint>,
            D::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        {
            let channel = ::ibex_transport::grpc::Endpoint::new(dst)?.connect().await?;
            Ok(Self::new(channel))
        }
    };
    quote! {
        pub use super::#tonic_mod::*;

        #[doc = #doc]
        #[derive(Debug, Clone)]
        pub struct #client<T = ::ibex_transport::grpc::Channel> {
            tonic: super::#tonic_mod::#client<T>,
            direct: ::ibex_transport::grpc::DirectClient,
        }

        /// tonic's client over an Ibex channel connects as tonic's generated `connect` does.
        impl super::#tonic_mod::#client<::ibex_transport::grpc::Channel> {
            #connect
        }

        impl #client<::ibex_transport::grpc::Channel> {
            #connect

            pub fn new(channel: ::ibex_transport::grpc::Channel) -> Self {
                Self {
                    direct: ::ibex_transport::grpc::DirectClient::new(&channel),
                    tonic: super::#tonic_mod::#client::new(channel),
                }
            }

            /// Compresses requests with `encoding` (every call then takes tonic's code).
            #[must_use]
            pub fn send_compressed(mut self, encoding: tonic::codec::CompressionEncoding) -> Self {
                self.tonic = self.tonic.send_compressed(encoding);
                self.direct.compressed();
                self
            }

            /// Accepts responses compressed with `encoding` (every call then takes tonic's
            /// code).
            #[must_use]
            pub fn accept_compressed(mut self, encoding: tonic::codec::CompressionEncoding) -> Self {
                self.tonic = self.tonic.accept_compressed(encoding);
                self.direct.compressed();
                self
            }

            /// Limits the size of a decoded response message (default 4 MiB).
            #[must_use]
            pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
                self.tonic = self.tonic.max_decoding_message_size(limit);
                self.direct.max_decoding_message_size(limit);
                self
            }

            /// Limits the size of an encoded request message (default `usize::MAX`).
            #[must_use]
            pub fn max_encoding_message_size(mut self, limit: usize) -> Self {
                self.tonic = self.tonic.max_encoding_message_size(limit);
                self.direct.max_encoding_message_size(limit);
                self
            }

            /// tonic's client over the same channel.
            pub fn into_tonic(self) -> super::#tonic_mod::#client<::ibex_transport::grpc::Channel> {
                self.tonic
            }

            #(#methods)*
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_build::Comments;

    fn method(name: &str, client_streaming: bool, server_streaming: bool) -> Method {
        Method {
            name: snake_case(name),
            proto_name: name.into(),
            comments: Comments::default(),
            input_type: "Req".into(),
            output_type: "Resp".into(),
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

    fn generate(svc: Service, client: bool, server: bool) -> String {
        let mut g = configure()
            .build_client(client)
            .build_server(server)
            .service_generator();
        let mut buf = String::new();
        g.generate(svc, &mut buf);
        buf
    }

    #[test]
    fn unary_methods_get_direct_handlers_and_calls_streaming_ones_stay_tonics() {
        let methods = vec![
            method("One", false, false),
            method("Two", false, false),
            method("Up", true, false),
            method("Down", false, true),
            method("Both", true, true),
        ];
        let code = generate(service("pkg.v1", methods), true, true);
        // tonic's modules are there as tonic writes them, the Ibex module after them.
        assert!(code.contains("pub mod svc_server"), "{code}");
        assert!(code.contains("pub mod svc_client"), "{code}");
        let (_, ibex) = code
            .split_once("pub mod svc_ibex")
            .expect("the Ibex module");
        assert_eq!(ibex.matches(".add_unary(").count(), 2, "{ibex}");
        assert!(ibex.contains("\"/pkg.v1.Svc/One\""), "{ibex}");
        assert!(ibex.contains("\"/pkg.v1.Svc/Two\""), "{ibex}");
        assert!(!ibex.contains("\"/pkg.v1.Svc/Up\""), "{ibex}");
        assert_eq!(
            ibex.matches(".unary(request.into_request()").count(),
            2,
            "{ibex}"
        );
        // Every method of the client, streaming ones through tonic's client.
        for m in ["one", "two", "up", "down", "both"] {
            assert!(
                code.contains(&format!("self.tonic.{m}(request).await")),
                "{m}: {code}"
            );
        }
        assert!(
            code.contains("impl tonic::IntoStreamingRequest<Message = super::Req>"),
            "{code}"
        );
        assert!(
            code.contains("tonic::codec::Streaming<super::Resp>"),
            "{code}"
        );
    }

    #[test]
    fn one_side_alone_and_no_package_generate_what_is_asked() {
        let one = || vec![method("One", false, false)];
        let code = generate(service("p", one()), false, true);
        assert!(code.contains("pub use super::svc_server::*"), "{code}");
        assert!(!code.contains("svc_client"), "{code}");
        let code = generate(service("p", one()), true, false);
        assert!(code.contains("pub use super::svc_client::*"), "{code}");
        assert!(!code.contains("svc_server"), "{code}");
        let code = generate(service("", one()), true, true);
        assert!(code.contains("\"/Svc/One\""), "{code}");
        let code = generate(service("p", one()), false, false);
        assert!(!code.contains("svc_ibex"), "{code}");
    }

    #[test]
    fn names_and_types_follow_tonics() {
        assert_eq!(snake_case("ParameterServer"), "parameter_server");
        assert_eq!(snake_case("Echo"), "echo");
        assert_eq!(message_type("()").to_string(), "()");
        assert_eq!(message_type("Req").to_string(), "super :: Req");
        assert_eq!(message_type("::x::Req").to_string(), ":: x :: Req");
        assert_eq!(
            message_type("super::other::Req").to_string(),
            "super :: super :: other :: Req"
        );
    }
}
