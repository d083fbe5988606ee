//! The rig proves itself: pods reach each other and nothing else, processes land in the
//! namespace, cgroup and user asked for, the eBPF build/load/attach path works, Envoy
//! starts, and nothing survives a test that panics or is killed.

use std::{
    io::{BufRead as _, BufReader},
    net::{SocketAddr, TcpStream},
    os::unix::fs::MetadataExt as _,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use weir_agent::capture::ebpf::probe::ConnectCounter;
use weir_tests::{Mesh, Placement, Pod, PodChild, envoy, require_root, test_cgroup, test_name, tools};

/// Starts the testkit echo server in `pod` and waits for its "listening" line.
fn echo_server(pod: &Pod, addr: SocketAddr) -> PodChild {
    let mut cmd = tools::testkit_command();
    cmd.args(["serve-echo", &addr.to_string()]).stdout(Stdio::piped());
    let mut child = pod.spawn(&mut cmd, 0).expect("spawn echo server");
    let stdout = child.child_mut().stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read listening line");
    assert!(line.starts_with("listening"), "echo server said {line:?}");
    child
}

fn testkit_connect(pod: &Pod, placement: Placement<'_>, addr: SocketAddr, count: u32) -> bool {
    let mut cmd = tools::testkit_command();
    cmd.args(["connect", &addr.to_string(), &count.to_string()]).stdout(Stdio::null());
    let mut child = pod.spawn_placed(&mut cmd, placement).expect("spawn client");
    child.child_mut().wait().expect("wait client").success()
}

#[test]
fn pods_reach_each_other_over_v4_and_v6_and_nothing_else() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let server = mesh.pod("server").unwrap();
    let client = mesh.pod("client").unwrap();
    let _v4 = echo_server(&server, (server.ipv4(), 7000).into());
    let _v6 = echo_server(&server, (server.ipv6(), 7001).into());

    assert!(testkit_connect(&client, Placement::default(), (server.ipv4(), 7000).into(), 2));
    assert!(testkit_connect(&client, Placement::default(), (server.ipv6(), 7001).into(), 2));
    // No route out: an address outside the mesh is unreachable from a pod.
    let outside = client
        .run(|| async {
            TcpStream::connect_timeout(&"192.0.2.1:80".parse().unwrap(), Duration::from_secs(1))
        })
        .unwrap();
    let err = outside.expect_err("a pod must have no route out");
    assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
}

#[test]
fn spawned_processes_run_in_the_pod_cgroup_and_user_asked_for() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let cgroup = test_cgroup(&test_name!());
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    let child = pod
        .spawn_placed(
            &mut cmd,
            Placement { cgroup: Some(&cgroup), user: Some((1337, 1337)), ..Placement::default() },
        )
        .unwrap();
    let pid = child.pid();
    let ns = std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap().ino();
    assert_eq!(ns, pod.netns().inode(), "process is in the pod's network namespace");
    assert_eq!(cgroup.procs().unwrap(), vec![pid], "process is in the test cgroup");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert_eq!(uid_line.split_whitespace().nth(1), Some("1337"), "{uid_line}");
    assert_eq!(pod.processes(), vec![pid]);
}

#[test]
fn ebpf_probe_counts_connects_made_in_its_cgroup_only() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let cgroup = test_cgroup(&test_name!());
    let counter = ConnectCounter::attach(cgroup.path()).expect("load and attach the probe");
    let addr: SocketAddr = (pod.ipv4(), 7100).into();
    let _server = echo_server(&pod, addr);
    assert_eq!(counter.count().unwrap(), 0);

    let inside = Placement { cgroup: Some(&cgroup), ..Placement::default() };
    assert!(testkit_connect(&pod, inside, addr, 3));
    assert_eq!(counter.count().unwrap(), 3, "three connects from inside the cgroup");

    assert!(testkit_connect(&pod, Placement::default(), addr, 4));
    assert_eq!(counter.count().unwrap(), 3, "connects from outside the cgroup are not seen");

    drop(counter);
    assert!(testkit_connect(&pod, inside, addr, 1), "detached: traffic still flows");
}

const SANDBOX_HELPER_ENV: &str = "WEIR_RIG_HELPER_OUT";

/// Not a test on its own: run by the cleanup tests in a child process. It builds a
/// sandbox, writes what it made to $WEIR_RIG_HELPER_OUT, then panics or hangs.
#[test]
#[ignore = "helper for the cleanup tests"]
fn helper_builds_a_sandbox_then_fails() {
    let Some(out) = std::env::var_os(SANDBOX_HELPER_ENV) else { return };
    let mesh = Mesh::new("cleanup-helper").unwrap();
    let pod = mesh.pod("p").unwrap();
    let cgroup = test_cgroup("cleanup-helper");
    let mut cmd = Command::new("sleep");
    cmd.arg("300");
    let child =
        pod.spawn_placed(&mut cmd, Placement { cgroup: Some(&cgroup), ..Placement::default() }).unwrap();
    let report = format!(
        "{}\n{}\n{}\n{}\n",
        pod.netns().path().display(),
        format_args!("/run/netns/{}-hub", mesh.name()),
        cgroup.path().display(),
        child.pid()
    );
    std::fs::write(&out, report).unwrap();
    if std::env::var("WEIR_RIG_HELPER_MODE").as_deref() == Ok("hang") {
        std::thread::sleep(Duration::from_secs(300));
    }
    panic!("the helper fails on purpose");
}

fn run_helper(mode: &str) -> (std::process::Child, std::path::PathBuf) {
    let out = std::env::temp_dir().join(format!("weir-rig-helper-{}-{mode}", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["helper_builds_a_sandbox_then_fails", "--exact", "--ignored", "--nocapture"])
        .env(SANDBOX_HELPER_ENV, &out)
        .env("WEIR_RIG_HELPER_MODE", mode)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (child, out)
}

fn read_report(out: &Path) -> Vec<String> {
    for _ in 0..300 {
        if let Ok(text) = std::fs::read_to_string(out)
            && text.lines().count() == 4
        {
            return text.lines().map(String::from).collect();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("helper wrote no report to {}", out.display());
}

fn assert_gone(report: &[String]) {
    assert!(!Path::new(&report[0]).exists(), "pod namespace {} remains", report[0]);
    assert!(!Path::new(&report[1]).exists(), "hub namespace {} remains", report[1]);
    assert!(!Path::new(&report[2]).exists(), "cgroup {} remains", report[2]);
    assert!(!running(&report[3]), "process {} remains", report[3]);
}

/// Whether `pid` is a live process: a zombie waiting for init to reap it is dead.
fn running(pid: &str) -> bool {
    for _ in 0..100 {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return false,
            Ok(stat) => {
                let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
                if matches!(state, Some('Z' | 'X')) {
                    return false;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn a_panicking_test_leaves_no_namespace_cgroup_or_process() {
    require_root!();
    let (mut child, out) = run_helper("panic");
    let status = child.wait().unwrap();
    let report = read_report(&out);
    let _ = std::fs::remove_file(&out);
    assert!(!status.success(), "the helper must have failed");
    for item in &report[..3] {
        assert!(
            item.contains("cleanup-helper") || item.contains("-hub"),
            "report names the helper's objects: {item}"
        );
    }
    assert_gone(&report);
}

#[test]
fn a_killed_test_is_reaped() {
    require_root!();
    let (mut child, out) = run_helper("hang");
    let report = read_report(&out);
    let _ = std::fs::remove_file(&out);
    // The sandbox exists while the helper runs ...
    assert!(Path::new(&report[0]).exists());
    assert!(Path::new(&report[2]).exists());
    // ... SIGKILL gives Drop no chance to run, and reaping removes it all, the
    // sleeping process included. (Another test's Mesh::new may reap it first: either
    // way it must be gone afterwards.)
    child.kill().unwrap();
    child.wait().unwrap();
    weir_tests::reap().unwrap();
    assert_gone(&report);
}

#[test]
fn real_envoy_starts_in_a_pod_as_the_proxy_user() {
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("proxy").unwrap();
    let admin: SocketAddr = "127.0.0.1:15000".parse().unwrap();
    let config = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 15000 } }
static_resources:
  listeners:
  - name: hello
    address: { socket_address: { address: 127.0.0.1, port_value: 18080 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: hello
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                direct_response: { status: 200, body: { inline_string: "hello from envoy" } }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
"#;
    let envoy = envoy::Envoy::start(&pod, config, admin, 1337).expect("start envoy");
    let status = std::fs::read_to_string(format!("/proc/{}/status", envoy.child.pid())).unwrap();
    assert!(status.lines().any(|l| l.starts_with("Uid:\t1337")), "Envoy runs as 1337");
    let reply = pod
        .run(|| async { weir_tests::http::get("127.0.0.1:18080".parse().unwrap(), "/").await })
        .unwrap()
        .unwrap();
    assert_eq!(reply, (200, "hello from envoy".to_string()));
    assert_eq!(envoy.stat(&pod, "http.hello.downstream_rq_2xx").unwrap(), Some(1));
}

/// A child's mounts are made in its own mount namespace, in order: an overlay adds a
/// mount point the host lacks (the host's files stay visible), a tmpfs and a
/// read-only file sit on it, the root turns read-only, the supplementary groups are
/// set; the host sees none of it.
#[test]
fn mounts_and_groups_exist_only_in_the_child() {
    use weir_agent::sandbox::process::Mount;
    require_root!();
    let mesh = Mesh::new(&test_name!()).unwrap();
    let pod = mesh.pod("app").unwrap();
    let dir = envoy::tempfile_dir::Dir::new("mounts").unwrap();
    let name = format!("weir-rig-{}", std::process::id());
    let (upper, work) = (dir.path().join("upper"), dir.path().join("work"));
    std::fs::create_dir_all(upper.join(&name)).unwrap();
    std::fs::create_dir(&work).unwrap();
    std::fs::write(upper.join(format!("{name}.conf")), "").unwrap();
    let source = dir.path().join("source.conf");
    std::fs::write(&source, "from the test\n").unwrap();
    let (mount_dir, mount_file) =
        (Path::new("/etc").join(&name), Path::new("/etc").join(format!("{name}.conf")));
    let mounts = [
        Mount::Overlay { target: "/etc".into(), upper, work, read_only: true },
        Mount::Tmpfs { target: mount_dir.clone(), options: "mode=1777".into() },
        Mount::Bind { source, target: mount_file.clone(), read_only: true },
        Mount::ReadOnly { target: "/".into() },
    ];
    let script = format!(
        "cat {file}; test -e /etc/passwd && echo host-etc-visible; \
         touch {dir}/x && echo tmpfs-writable; \
         (echo no > {file}) 2>/dev/null || echo file-read-only; \
         touch /tmp/{name} 2>/dev/null || echo root-read-only; id -G",
        file = mount_file.display(),
        dir = mount_dir.display(),
    );
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &script]).stdout(Stdio::piped()).stderr(Stdio::piped());
    let placement = Placement {
        user: Some((1000, 1000)),
        groups: &[1234, 2345],
        mounts: &mounts,
        ..Placement::default()
    };
    let out = pod.spawn_placed(&mut cmd, placement).unwrap().into_inner().wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "from the test\nhost-etc-visible\ntmpfs-writable\nfile-read-only\nroot-read-only\n1000 1234 2345\n",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!mount_dir.exists() && !mount_file.exists(), "the host's /etc is untouched");
    assert!(!Path::new("/tmp").join(&name).exists());
    let host = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!host.lines().any(|l| l.split(' ').nth(4) == Some("/etc")), "no mount on the host's /etc");

    // An overlay path overlayfs would misread is refused before anything runs.
    let bad = [Mount::Overlay {
        target: "/etc".into(),
        upper: "/tmp/a,b".into(),
        work: "/tmp/w".into(),
        read_only: false,
    }];
    let e = pod
        .spawn_placed(&mut Command::new("true"), Placement { mounts: &bad, ..Placement::default() })
        .unwrap_err()
        .to_string();
    assert!(e.contains("overlay path \"/tmp/a,b\""), "{e}");
}
