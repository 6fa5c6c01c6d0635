//! What ships to run the gateway elsewhere: the container image's files and
//! the Kubernetes manifests, rendered by `kubectl kustomize` and checked
//! object by object against the policy they carry.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;
use support::Gateway;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `tollgate check` on a policy text, from a file of its own.
fn check(name: &str, policy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tollgate.yaml");
    std::fs::write(&file, policy).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name} fails `tollgate check`:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The objects `kubectl kustomize` renders from `dir`. Fails, never skips,
/// without a kubectl that can: the manifests use kustomize v4.2's fields.
fn render(dir: &str) -> Vec<Value> {
    let out = Command::new("kubectl")
        .args(["kustomize", &format!("{ROOT}/{dir}")])
        .output()
        .unwrap_or_else(|e| {
            panic!("kubectl is needed to render {dir} (1.22 or later, e.g. from pkgs.k8s.io): {e}")
        });
    assert!(
        out.status.success(),
        "kubectl kustomize {dir} failed (kubectl 1.22 or later is needed):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .collect()
}

fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

fn port_of(addr: &Value) -> SocketAddr {
    str_of(addr).parse().unwrap()
}

/// The container port a probe or target names, by name or number.
fn container_port(container: &Value, port: &Value) -> u64 {
    match port.as_u64() {
        Some(n) => n,
        None => container["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == *port)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no container port {port:?}")),
    }
}

/// Checks one rendering: its policy, and the objects around it.
fn check_rendering(dir: &str) -> Value {
    let objects = render(dir);
    let text = str_of(&object(&objects, "ConfigMap", "tollgate-policy")["data"]["tollgate.yaml"]);
    check(dir, text);
    let policy: Value = serde_yaml::from_str(text).unwrap();
    let server = &policy["server"];
    let admin = port_of(&server["admin_listen"]);
    assert!(
        admin.ip().is_unspecified(),
        "{dir}: the kubelet probes the pod's address"
    );
    let listen = port_of(&server["listen"][0]);

    let deployment = object(&objects, "Deployment", "tollgate");
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];

    // Probes on the admin listener, which answers them without a token.
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{dir}: {probe}");
        assert_eq!(
            container_port(container, &get["port"]),
            u64::from(admin.port()),
            "{dir}: {probe}"
        );
    }
    assert_eq!(
        container_port(container, &"http".into()),
        u64::from(listen.port())
    );

    // The policy file is where the container reads it, from the ConfigMap.
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(str_of)
        .collect();
    let config = args[args.iter().position(|a| *a == "--config").unwrap() + 1];
    let mount = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| config == format!("{}/tollgate.yaml", str_of(&m["mountPath"])))
        .unwrap_or_else(|| panic!("{dir}: {config} is not mounted"));
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["configMap"]["name"], "tollgate-policy");

    // Secrets from the Secret, under the names the policy reads.
    let env = container["env"].as_sequence().unwrap();
    for name in [
        &server["admin_token_env"],
        &policy["store"]["key_secret_env"],
    ] {
        let var = env
            .iter()
            .find(|e| e["name"] == *name)
            .unwrap_or_else(|| panic!("{dir}: no {name:?}"));
        assert!(
            var["valueFrom"]["secretKeyRef"]["name"].is_string(),
            "{dir}: {name:?}"
        );
    }

    // Stopping: the preStop wait and the drain fit in the grace period.
    let wait: u64 = str_of(&container["lifecycle"]["preStop"]["exec"]["command"][1])
        .parse()
        .unwrap();
    let drain = server["shutdown_grace_seconds"].as_u64().unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > wait + drain + 1,
        "{dir}: {grace} s <= {wait} + {drain} + 1"
    );

    // Non-root, read-only, with resources.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_ne!(pod["securityContext"]["runAsUser"], 0);
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert!(container["resources"]["requests"]["memory"].is_string());
    assert!(container["resources"]["limits"]["memory"].is_string());

    // Reached through the Service, kept up by the budget, scraped.
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let service = object(&objects, "Service", "tollgate");
    for (key, value) in service["spec"]["selector"].as_mapping().unwrap() {
        assert_eq!(&labels[key], value, "{dir}: the Service selects the pods");
    }
    let service_port = |name: &str| {
        let port = service["spec"]["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap();
        container_port(container, &port["targetPort"])
    };
    assert_eq!(service_port("http"), u64::from(listen.port()));
    assert_eq!(service_port("admin"), u64::from(admin.port()));
    let budget = object(&objects, "PodDisruptionBudget", "tollgate");
    assert_eq!(
        budget["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"]
    );
    let monitor = object(&objects, "ServiceMonitor", "tollgate");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "admin");
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
    for (key, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .unwrap()
    {
        assert_eq!(
            &service["metadata"]["labels"][key], value,
            "{dir}: the monitor selects the Service"
        );
    }

    // The shipped rules, which promtool unit-tests, as they are.
    let rules: Value = serde_yaml::from_str(&read("deploy/prometheus/alerts.yaml")).unwrap();
    let rule = object(&objects, "PrometheusRule", "tollgate");
    assert_eq!(
        rule["spec"]["groups"], rules["groups"],
        "{dir}: copy deploy/prometheus/alerts.yaml's groups"
    );
    policy
}

#[test]
fn the_base_renders_a_deployment_its_policy_and_probes_agree_with() {
    let policy = check_rendering("deploy/kubernetes/base");
    assert_eq!(policy["store"]["backend"], "memory");
}

#[test]
fn the_redis_overlay_shares_limits_through_a_redis_it_brings() {
    let policy = check_rendering("deploy/kubernetes/overlays/redis");
    assert_eq!(policy["store"]["backend"], "redis");
    let url = str_of(&policy["store"]["urls"][0]);
    let host = url
        .trim_start_matches("redis://")
        .split([':', '/'])
        .next()
        .unwrap();
    let objects = render("deploy/kubernetes/overlays/redis");
    let service = object(&objects, "Service", host);
    let redis = objects
        .iter()
        .find(|o| {
            o["kind"] == "Deployment"
                && service["spec"]["selector"]
                    .as_mapping()
                    .unwrap()
                    .iter()
                    .all(|(k, v)| o["spec"]["template"]["metadata"]["labels"][k] == *v)
        })
        .expect("a Deployment behind the Redis Service");
    assert_eq!(
        redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
        true
    );
}

#[test]
fn the_image_serves_its_demo_policy_as_a_non_root_user() {
    let dockerfile = read("Dockerfile");
    let lines: Vec<&str> = dockerfile
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect();
    let has = |prefix: &str| lines.iter().any(|l| l.starts_with(prefix));
    assert!(has(
        "COPY deploy/docker/tollgate.yaml /etc/tollgate/tollgate.yaml"
    ));
    assert!(has(
        r#"CMD ["run", "--config", "/etc/tollgate/tollgate.yaml"]"#
    ));
    assert!(has("HEALTHCHECK "));
    // The patched crates the manifest builds from vendor/ are in the build.
    if read("Cargo.toml").contains("path = \"vendor/") {
        assert!(has("COPY vendor ./vendor"));
    }
    // No anonymous volume over the policy's directory: a file is mounted.
    assert!(!has("VOLUME"));
    let user = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER");
    assert!(!["root", "0", "0:0"].contains(&user.trim()), "USER {user}");

    let demo = read("deploy/docker/tollgate.yaml");
    check("the demo policy", &demo);
    assert_eq!(demo.lines().next(), Some(tollgate::config::DEMO_MARKER));
    let policy: Value = serde_yaml::from_str(&demo).unwrap();
    assert_eq!(policy["server"]["listen"][0], "0.0.0.0:8080");
    // The HEALTHCHECK asks the admin listener the policy opens.
    let admin = port_of(&policy["server"]["admin_listen"]);
    assert!(dockerfile.contains(&format!("/dev/tcp/127.0.0.1/{}", admin.port())));
    let routes = policy["routes"].as_sequence().unwrap();
    assert!(
        routes.iter().all(|r| r["respond"].is_mapping()),
        "the demo needs no upstream"
    );
}

#[test]
fn the_gateway_warns_that_it_serves_the_demo_policy() {
    let demo = read("deploy/docker/tollgate.yaml")
        .replace("0.0.0.0:8080", "{listen}")
        .replace("127.0.0.1:9091", "{admin}");
    let gw = Gateway::start(&demo, None);
    assert!(gw.log().contains("serving the demo policy"), "{}", gw.log());
    let reply = gw.get("/v1/hello", &[("authorization", "Bearer tg_demo_4f1c2a")]);
    assert_eq!(reply.status, 200);

    let own = read("deploy/docker/tollgate.yaml")
        .replacen(tollgate::config::DEMO_MARKER, "# my policy", 1)
        .replace("0.0.0.0:8080", "{listen}")
        .replace("127.0.0.1:9091", "{admin}");
    let gw = Gateway::start(&own, None);
    assert!(!gw.log().contains("demo policy"), "{}", gw.log());
}
