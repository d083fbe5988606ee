#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora into tests/fuzz/seeds/<target>/.

Seeds are real inputs: pods, probers, istio-init command lines and scrape annotations
taken from Istio's injector goldens (shared/conformance/istio/inject, when present),
plus wire messages built here field by field (DNS queries, HTTP/2 request headers, NDS
tables, Wasm ECDS resources) and a CA chain made with openssl. Run it again to
refresh; the output is committed, so CI never runs it.
"""
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SEEDS = HERE / "seeds"
ROOT = HERE.parent.parent
CONFORMANCE = pathlib.Path(os.environ.get("WEIR_CONFORMANCE", ROOT.parent / "shared/conformance/istio"))


def put(target, name, data):
    d = SEEDS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# --- protobuf, by hand ------------------------------------------------------------
def varint(n):
    out = b""
    while n >= 0x80:
        out += bytes([(n & 0x7F) | 0x80])
        n >>= 7
    return out + bytes([n])


def ld(field, payload):
    payload = payload.encode() if isinstance(payload, str) else payload
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def vi(field, n):
    return varint(field << 3) + varint(n)


# --- from Istio's injector goldens -------------------------------------------------
def injector_seeds():
    import yaml

    inject = CONFORMANCE / "inject"
    if not inject.is_dir():
        print(f"no {inject}: skipping the injector's seeds", file=sys.stderr)
        return
    for f in sorted(inject.glob("*.injected")):
        stem = f.name.split(".")[0]
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "Deployment":
                template = doc["spec"]["template"]
                doc = {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata") or {},
                       "spec": template["spec"]}
                doc["metadata"].setdefault("name", stem)
            if not doc or doc.get("kind") != "Pod":
                continue
            doc.setdefault("metadata", {}).setdefault("namespace", "default")
            doc.setdefault("status", {})["podIP"] = "10.1.2.3"
            put("pod_json", f"{stem}.json", json.dumps(doc, indent=1))
            ann = doc["metadata"].get("annotations", {})
            put("pod_annotations", stem, "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(ann.items())))
            spec = doc.get("spec", {})
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                if c.get("name") == "istio-init" and c.get("args", [None])[0] == "istio-iptables":
                    put("istio_iptables", stem, "\n".join(c["args"][1:]) + "\n")
                for e in c.get("env", []):
                    if e.get("name") == "ISTIO_KUBE_APP_PROBERS":
                        put("app_probers", stem, e["value"])
                    if e.get("name") == "ISTIO_PROMETHEUS_ANNOTATIONS":
                        put("prometheus_merge", stem, e["value"] + "\0a_total 1\n# EOF\n\0envoy_x{a=\"b\"} 2\n")


# --- built here --------------------------------------------------------------------
def cni_seeds():
    conf = {
        "cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "istio-cni",
        "plugin_log_level": "info", "cni_agent_run_dir": "/var/run/istio-cni",
        "exclude_namespaces": ["kube-system"],
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
                       "ips": [{"address": "10.1.2.3/24", "gateway": "10.1.2.1", "interface": 0}],
                       "dns": {}},
    }
    put("cni_netconf", "istio-1.0.0", json.dumps(conf))
    legacy = {"cniVersion": "0.3.1", "name": "istio-cni", "type": "istio-cni", "log_level": "debug",
              "kubernetes": {"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig",
                             "cni_bin_dir": "/opt/cni/bin", "exclude_namespaces": ["istio-system"]},
              "capture_mode": "iptables", "native_nftables": True}
    put("cni_netconf", "legacy-0.3.1", json.dumps(legacy))
    put("cni_args", "containerd",
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=u-1")
    put("cni_args", "invocation",
        "CNI_COMMAND=ADD\nCNI_CONTAINERID=abc\nCNI_NETNS=/var/run/netns/cni-1\nCNI_IFNAME=eth0\n"
        "CNI_PATH=/opt/cni/bin:/usr/lib/cni\nCNI_ARGS=K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0\n")


def config_seeds():
    put("istio_iptables", "env-tproxy-dual-stack",
        "ENV ISTIO_INBOUND_INTERCEPTION_MODE=TPROXY\nENV ISTIO_META_DNS_CAPTURE=true\n-p\n15001\n--dual-stack\n"
        "-x\n10.0.0.0/8,fd00::/8\n-o\n22,15090\n-k\neth1\n--redirect-dns\n--drop-invalid=true\n"
        "-n\n--iptables-probe-port=15002\n--probe-timeout=5s\n")
    put("istio_iptables", "native-nftables", "-p\n15001\n-z\n15006\n-u\n1337\n-g\n1337,java\n-m\nREDIRECT\n"
        "-i\n*\n-b\n8080,9090\n-q\n443\n-c\neth2\n--native-nftables\n--capture-all-dns\n")
    mesh = "defaultConfig:\n  discoveryAddress: istiod.istio-system.svc:15012\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\n  holdApplicationUntilProxyStarts: true\ntrustDomain: cluster.local\n"
    proxy = '{"concurrency": 2, "drainDuration": "45s", "proxyMetadata": {"A": "b"}}'
    ann = "terminationDrainDuration: 30s\ninterception_mode: TPROXY\n"
    put("proxy_config", "layers", "\n%%\n".join([mesh, proxy, ann, "--domain\ndefault.svc.cluster.local"]))
    put("proxy_config", "mesh-only", mesh)
    kube = """apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://10.96.0.1:443
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg==
users:
- name: istio-cni
  user:
    token: abc.def
contexts:
- name: istio-cni-context
  context:
    cluster: local
    user: istio-cni
current-context: istio-cni-context
"""
    put("kubeconfig", "istio-cni", kube)
    services = """trustDomain: cluster.local
services:
- name: reviews
  namespace: bookinfo
  address: 10.0.0.10
  port: 9080
  endpoints: [127.0.0.1:19080, 127.0.0.2:19080]
  timeout: 1.5s
  retries: 2
- name: db
  serviceAccount: mysql
  address: 10.0.0.11
  port: 3306
  protocol: tcp
  endpoints: ["[::1]:13306"]
"""
    put("standalone_services", "two-services", services)
    put("prometheus_merge", "openmetrics",
        '{"scrape":"true","targets":[{"port":"9000","path":"/m"}]}\0# TYPE a counter\na_total 1\n# EOF\n\0b 2')


def dns_query(name, qtype, edns=None, qid=0x1234):
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 1 if edns else 0)
    for label in name.strip(".").split("."):
        q += bytes([len(label)]) + label.encode()
    q += b"\0" + struct.pack(">HH", qtype, 1)
    if edns:
        q += b"\0" + struct.pack(">HHIH", 41, edns, 0, 0)
    return q


def dns_seeds():
    queries = {
        "a-short": dns_query("reviews", 1),
        "aaaa-fqdn": dns_query("reviews.default.svc.cluster.local", 28, edns=1232),
        "wildcard": dns_query("x.wild.example.com", 1),
        "big-edns": dns_query("big.example.com", 1, edns=4096),
        "unknown": dns_query("example.org", 1),
    }
    for name, q in queries.items():
        put("dns_udp", name, q)
        put("dns_tcp", name, struct.pack(">H", len(q)) + q + struct.pack(">H", len(q)) + q)


def nds_seeds():
    def entry(host, info):
        return ld(1, ld(1, host) + ld(2, info))

    k8s = ld(1, "10.0.0.1") + ld(1, "fd00::1") + ld(2, "Kubernetes") + ld(3, "reviews") + ld(4, "default")
    ext = ld(1, "::ffff:10.0.0.2") + ld(2, "External") + ld(5, "alt.example.com")
    put("nds_table", "kubernetes-and-external",
        entry("reviews.default.svc.cluster.local", k8s) + entry("*.example.com", ext))


def wasm_seeds():
    http_uri = ld(1, "https://example.com/plugin.wasm") + ld(3, vi(1, 30))
    remote = ld(1, http_uri) + ld(2, "ABCDEF0123")
    code = ld(2, remote)  # AsyncDataSource.remote
    vm = ld(1, "vm") + ld(2, "envoy.wasm.runtime.v8") + ld(3, code)
    plugin = ld(1, "ns.plugin") + ld(2, "root") + ld(3, vm) + vi(5, 1)
    wasm = ld(1, plugin)
    for kind, url in [("http", "envoy.extensions.filters.http.wasm.v3.Wasm"),
                      ("network", "envoy.extensions.filters.network.wasm.v3.Wasm")]:
        typed = ld(1, "type.googleapis.com/" + url) + ld(2, wasm)
        put("wasm_ecds", f"remote-{kind}", ld(1, "ns.plugin") + ld(2, typed))


def hpack_literal(name, value):
    return b"\0" + varint7(len(name)) + name + varint7(len(value)) + value


def varint7(n):
    if n < 127:
        return bytes([n])
    out, n = bytes([127]), n - 127
    while n >= 0x80:
        out += bytes([(n & 0x7F) | 0x80])
        n >>= 7
    return out + bytes([n])


def frame(kind, flags, stream, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def h2_seeds():
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = frame(0x4, 0, 0, struct.pack(">HI", 3, 100))
    def request(authority):
        return b"".join(hpack_literal(n, v) for n, v in [
            (b":method", b"POST"), (b":scheme", b"http"),
            (b":path", b"/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"),
            (b":authority", authority), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    block = request(b"%2Fetc%2Fistio%2Fproxy%2FXDS")
    put("h2_authority", "grpc-core-socket-path", preface + settings + frame(0x1, 0x4, 1, block)
        + frame(0x0, 0x1, 1, b"\0\0\0\0\0"))
    split = len(block) // 2
    put("h2_authority", "continuation", preface + settings + frame(0x1, 0x8, 3, b"\x02" + block[:split] + b"\0\0")
        + frame(0x9, 0x4, 3, block[split:]))
    # Indexed fields and a dynamic-table insert, as a real encoder writes them.
    put("h2_authority", "indexed", preface + frame(0x1, 0x5, 1, b"\x83\x86\x44\x01/\x41\x08xds-grpc\xbe"))


def pem_seeds():
    with tempfile.TemporaryDirectory() as t:
        def run(*args):
            subprocess.run(["openssl", *args], cwd=t, check=True, capture_output=True)
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "ca.key",
            "-out", "ca.pem", "-days", "36500", "-subj", "/O=cluster.local")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "leaf.key",
            "-out", "leaf.csr", "-subj", "/")
        ext = pathlib.Path(t, "ext")
        ext.write_text("subjectAltName=URI:spiffe://cluster.local/ns/default/sa/default\n")
        run("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "leaf.pem", "-days", "36500", "-extfile", "ext")
        ca = pathlib.Path(t, "ca.pem").read_text()
        leaf = pathlib.Path(t, "leaf.pem").read_text()
    put("ca_pem_chain", "leaf-and-root", leaf + ca)
    put("ca_pem_chain", "root", ca)


def main():
    injector_seeds()
    cni_seeds()
    config_seeds()
    dns_seeds()
    nds_seeds()
    wasm_seeds()
    h2_seeds()
    pem_seeds()
    for d in sorted(SEEDS.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds")


if __name__ == "__main__":
    main()
