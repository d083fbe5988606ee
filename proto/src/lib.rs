//! The protobuf APIs Weir speaks, generated at build time from the trimmed files under
//! `proto/protos` (origins in `proto/README.md`). Module paths follow proto packages.
//! xDS resources stay `prost_types::Any`: the relay forwards them undecoded.

#![allow(clippy::all, missing_docs, reason = "generated code")]

pub mod grpc {
    pub mod health {
        pub mod v1 {
            tonic::include_proto!("grpc.health.v1");
        }
    }
}

pub mod google {
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
        pub mod listener {
            pub mod v3 {
                tonic::include_proto!("envoy.config.listener.v3");
            }
        }
        pub mod cluster {
            pub mod v3 {
                tonic::include_proto!("envoy.config.cluster.v3");
            }
        }
        pub mod endpoint {
            pub mod v3 {
                tonic::include_proto!("envoy.config.endpoint.v3");
            }
        }
        pub mod route {
            pub mod v3 {
                tonic::include_proto!("envoy.config.route.v3");
            }
        }
    }
    pub mod r#type {
        pub mod matcher {
            pub mod v3 {
                tonic::include_proto!("envoy.r#type.matcher.v3");
            }
        }
    }
    pub mod service {
        pub mod discovery {
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
        pub mod secret {
            pub mod v3 {
                tonic::include_proto!("envoy.service.secret.v3");
            }
        }
    }
    pub mod extensions {
        pub mod filters {
            pub mod network {
                pub mod http_connection_manager {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.network.http_connection_manager.v3");
                    }
                }
                pub mod wasm {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.network.wasm.v3");
                    }
                }
                pub mod tcp_proxy {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.network.tcp_proxy.v3");
                    }
                }
            }
            pub mod http {
                pub mod wasm {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.http.wasm.v3");
                    }
                }
                pub mod router {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.http.router.v3");
                    }
                }
            }
            pub mod listener {
                pub mod original_dst {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.filters.listener.original_dst.v3");
                    }
                }
            }
        }
        pub mod wasm {
            pub mod v3 {
                tonic::include_proto!("envoy.extensions.wasm.v3");
            }
        }
        pub mod transport_sockets {
            pub mod tls {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.transport_sockets.tls.v3");
                }
            }
        }
    }
}

pub mod istio {
    pub mod v1 {
        pub mod auth {
            tonic::include_proto!("istio.v1.auth");
        }
    }
    pub mod networking {
        pub mod nds {
            pub mod v1 {
                tonic::include_proto!("istio.networking.nds.v1");
            }
        }
    }
    /// ZDS, the node agent ⇄ ztunnel protocol (one message per SOCK_SEQPACKET datagram).
    pub mod workload {
        /// Workload discovery (`istio.workload`: what istiod sends ztunnel); only with
        /// the `rig` feature (the test rig's istiod).
        #[cfg(feature = "rig")]
        pub mod api {
            tonic::include_proto!("istio.workload");
        }
        pub mod zds {
            tonic::include_proto!("istio.workload.zds");
        }
    }
}

/// Type URLs of the resources Weir handles by name.
pub mod type_url {
    pub const PREFIX: &str = "type.googleapis.com/";
    pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
    pub const EXTENSION_CONFIG: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
    pub const NAME_TABLE: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
    pub const HEALTH_INFO: &str = "type.googleapis.com/istio.v1.HealthInformation";
}

/// Wraps a message as `Any` under its full type URL.
pub fn to_any<M: prost::Message>(type_url: &str, message: &M) -> prost_types::Any {
    prost_types::Any { type_url: type_url.to_string(), value: message.encode_to_vec() }
}

/// Kubernetes CRI v1 (`runtime.v1`): what kubelet asks a container runtime. Only with
/// the `rig` feature (the test rig's kubelet stand-in).
#[cfg(feature = "rig")]
pub mod cri {
    tonic::include_proto!("runtime.v1");
}
