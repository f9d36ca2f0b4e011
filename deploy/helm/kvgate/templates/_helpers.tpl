{{/* Names and labels */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}


{{/* An image reference: repository:tag (the chart's appVersion when tag is empty), and @digest
     when one is given, so a node runs exactly the image pinned. Args: (list $ .Values.image). */}}
{{- define "kvgate.image" -}}
{{- $ctx := index . 0 -}}
{{- $img := index . 1 -}}
{{- printf "%s:%s" $img.repository ($img.tag | default $ctx.Chart.AppVersion) -}}
{{- with $img.digest -}}@{{ . }}{{- end -}}
{{- end -}}

{{/* Selector labels of the gateway pods */}}
{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/* Labels of the gateway's pod template: the selector labels plus the recommended labels that
     change between releases (never in the selector, which is immutable). */}}
{{- define "kvgate.podLabels" -}}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.secretName" -}}{{ include "kvgate.fullname" . }}-secrets{{- end -}}
{{- define "kvgate.tenantsSecretName" -}}
{{- default (printf "%s-tenants" (include "kvgate.fullname" .)) .Values.tenants.existingSecret -}}
{{- end -}}

{{/* The state directory: a folder kvgate creates (mode 0700) inside the pod's emptyDir. */}}
{{- define "kvgate.stateDir" -}}/var/lib/kvgate/data/state{{- end -}}

{{/* A CPU quantity ("2", 1.5, "1500m") rounded up to whole cores. */}}
{{- define "kvgate.cpuCeil" -}}
{{- $cpu := toString . -}}
{{- if hasSuffix "m" $cpu -}}
{{- div (add (trimSuffix "m" $cpu | int) 999) 1000 -}}
{{- else -}}
{{- ceil (float64 $cpu) | int -}}
{{- end -}}
{{- end -}}

{{/* Worker processes per pod: .Values.workers, else the CPU limit rounded up, else 1. */}}
{{- define "kvgate.workers" -}}
{{- if .Values.workers -}}
{{- .Values.workers | int -}}
{{- else -}}
{{- $limits := (.Values.resources | default dict).limits | default dict -}}
{{- if hasKey $limits "cpu" -}}
{{- max 1 (include "kvgate.cpuCeil" $limits.cpu | int) -}}
{{- else -}}
1
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The most gateway pods at once: what local_fallback divides limits by. */}}
{{- define "kvgate.maxPods" -}}
{{- if .Values.autoscaling.enabled -}}{{ .Values.autoscaling.maxReplicas | int }}{{- else -}}{{ .Values.replicaCount | int }}{{- end -}}
{{- end -}}

{{/* The fewest gateway pods the Deployment is scaled to. */}}
{{- define "kvgate.minPods" -}}
{{- if .Values.autoscaling.enabled -}}{{ .Values.autoscaling.minReplicas | int }}{{- else -}}{{ .Values.replicaCount | int }}{{- end -}}
{{- end -}}

{{- define "kvgate.drainTimeoutSeconds" -}}
{{- $gw := (.Values.config | default dict).gateway | default dict -}}
{{- if hasKey $gw "drain_timeout_seconds" -}}{{ ceil (float64 $gw.drain_timeout_seconds) | int }}{{- else -}}30{{- end -}}
{{- end -}}

{{- define "kvgate.terminationGracePeriodSeconds" -}}
{{- $drain := add (int .Values.drain.preStopSleepSeconds) (include "kvgate.drainTimeoutSeconds" . | int) -}}
{{- $need := add $drain 2 -}}
{{- if .Values.drain.terminationGracePeriodSeconds -}}
{{- if lt (int .Values.drain.terminationGracePeriodSeconds) $need -}}
{{- fail (printf "drain.terminationGracePeriodSeconds (%d) is below preStopSleepSeconds + gateway.drain_timeout_seconds + 2 s for ending the requests still in flight (%d): the kubelet would kill them before they are ended and settled" (int .Values.drain.terminationGracePeriodSeconds) $need) -}}
{{- end -}}
{{- .Values.drain.terminationGracePeriodSeconds | int -}}
{{- else -}}
{{- add $drain 10 -}}
{{- end -}}
{{- end -}}

{{/* Redis URL (into KVGATE_REDIS_URL); passwords are $(VAR) references the kubelet fills in. */}}
{{- define "kvgate.redisUrl" -}}
{{- $r := .Values.redis -}}
{{- $scheme := ternary "rediss" "redis" (eq (toString $r.tls.enabled) "true") -}}
{{- if eq $r.mode "sentinel" -}}{{- $scheme = printf "%s+sentinel" $scheme -}}{{- end -}}
{{- if eq $r.mode "cluster" -}}{{- $scheme = printf "%s+cluster" $scheme -}}{{- end -}}
{{- $user := "" -}}
{{- if $r.password.existingSecret -}}
{{- $user = printf "%s:$(REDIS_PASSWORD)@" $r.username -}}
{{- else if $r.username -}}
{{- $user = printf "%s@" $r.username -}}
{{- end -}}
{{- $path := "" -}}
{{- if eq $r.mode "sentinel" -}}{{- $path = printf "/%s/%d" $r.sentinelMasterName (int $r.db) -}}{{- end -}}
{{- if eq $r.mode "standalone" -}}{{- $path = printf "/%d" (int $r.db) -}}{{- end -}}
{{- $query := list -}}
{{- if and (eq $r.mode "sentinel") $r.sentinelPassword.existingSecret -}}
{{- $query = append $query "sentinel_password=$(REDIS_SENTINEL_PASSWORD)" -}}
{{- end -}}
{{- if and $r.tls.enabled $r.tls.caSecret.name -}}
{{- $query = append $query (printf "ssl_ca_certs=/etc/kvgate/redis-tls/%s" $r.tls.caSecret.key) -}}
{{- end -}}
{{- if and $r.tls.enabled (eq $r.mode "sentinel") (eq (toString $r.tls.sentinels) "false") -}}
{{- $query = append $query "sentinel_ssl=false" -}}
{{- end -}}
{{- printf "%s://%s%s%s" $scheme $user (join "," $r.hosts) $path -}}
{{- if $query -}}?{{ join "&" $query }}{{- end -}}
{{- end -}}

{{/* Upstreams as kvgate.yaml lists them: the bundled backend's added, apiKeySecret turned into
     an api_key of $(UPSTREAM_<i>_API_KEY) (only ever sent through the environment). */}}
{{- define "kvgate.upstreams" -}}
{{- $out := list -}}
{{- range $i, $u := .Values.upstreams -}}
{{- $e := omit $u "apiKeySecret" -}}
{{- if $u.apiKeySecret -}}{{- $_ := set $e "api_key" (printf "$(UPSTREAM_%d_API_KEY)" $i) -}}{{- end -}}
{{- $out = append $out $e -}}
{{- end -}}
{{- if .Values.backend.enabled -}}
{{- $fn := include "kvgate.fullname" . -}}
{{- $out = append $out (dict "name" "bundled" "api_url" (printf "http://%s-router:30000/v1" $fn) "pool_source" "kvgate" "pool_urls" (list (printf "http://%s-prefill:30001/server_info" $fn)) "models" (list .Values.backend.servedModelName)) -}}
{{- end -}}
{{- toJson (dict "upstreams" $out) -}}
{{- end -}}

{{- define "kvgate.upstreamsHaveKeys" -}}
{{- range .Values.upstreams -}}{{- if .apiKeySecret -}}yes{{- end -}}{{- end -}}
{{- end -}}

{{/* kvgate.yaml: .Values.config with the keys the chart owns. */}}
{{- define "kvgate.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- $gw := deepCopy ($cfg.gateway | default dict) -}}
{{- $_ := set $gw "host" "0.0.0.0" -}}
{{- $_ = set $gw "port" (int .Values.containerPort) -}}
{{- $_ = set $gw "workers" (include "kvgate.workers" . | int) -}}
{{- $_ = set $cfg "gateway" $gw -}}
{{- $q := deepCopy ($cfg.quotas | default dict) -}}
{{- if not (hasKey $q "replicas") -}}{{- $_ = set $q "replicas" (include "kvgate.maxPods" . | int) -}}{{- end -}}
{{- $_ = set $cfg "quotas" $q -}}
{{- $_ = set $cfg "state_dir" (include "kvgate.stateDir" .) -}}
{{- $models := $cfg.models | default list -}}
{{- if .Values.backend.enabled -}}
{{- $have := false -}}
{{- range $models -}}{{- if eq .id $.Values.backend.servedModelName -}}{{- $have = true -}}{{- end -}}{{- end -}}
{{- if not $have -}}
{{- /* the built-in models count with kvgate's bundled tokenizer; a model folder with the router's /v1/tokenize */}}
{{- $tok := dict "kind" "bundled" -}}
{{- if not (has .Values.backend.model (list "tiny-random" "copy-probe")) -}}
{{- $tok = dict "kind" "engine" "engine_api" "sglang" "url" (printf "http://%s-router:30000" (include "kvgate.fullname" .)) -}}
{{- end -}}
{{- $models = append $models (dict "id" .Values.backend.servedModelName "context_length" (int .Values.backend.contextLength) "tokenizer" $tok) -}}
{{- end -}}
{{- end -}}
{{- $_ = set $cfg "models" $models -}}
{{- if not (include "kvgate.upstreamsHaveKeys" .) -}}
{{- $_ = set $cfg "upstreams" (fromJson (include "kvgate.upstreams" .)).upstreams -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* A generated secret value: the one already stored in the chart's Secret (kept across
     upgrades), else 48 random letters and digits. Args: (list $ key). */}}
{{- define "kvgate.generated" -}}
{{- $ctx := index . 0 -}}
{{- $key := index . 1 -}}
{{- $existing := lookup "v1" "Secret" $ctx.Release.Namespace (include "kvgate.secretName" $ctx) -}}
{{- if and $existing (hasKey ($existing.data | default dict) $key) -}}
{{- index $existing.data $key | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}

{{/* The first tenant's API key, generated once: sk-kvg- + 43 URL-safe characters, as `kvgate tenant` makes them. */}}
{{- define "kvgate.firstTenantKey" -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kvgate.secretName" .) -}}
{{- if and $existing (hasKey ($existing.data | default dict) "first-tenant-api-key") -}}
{{- index $existing.data "first-tenant-api-key" | b64dec -}}
{{- else -}}
{{- printf "sk-kvg-%s" (randAlphaNum 43) -}}
{{- end -}}
{{- end -}}

{{/* Refuse values that would render a gateway that cannot work as asked. */}}
{{- define "kvgate.validate" -}}
{{- $cfg := .Values.config | default dict -}}
{{- range $k := list "redis_url" "state_dir" "upstreams" -}}
{{- if hasKey $cfg $k -}}{{- fail (printf "config.%s is set by the chart (see values.yaml: redis, upstreams); remove it from config" $k) -}}{{- end -}}
{{- end -}}
{{- $gw := $cfg.gateway | default dict -}}
{{- range $k := list "host" "port" "workers" "metrics_token" -}}
{{- if hasKey $gw $k -}}{{- fail (printf "config.gateway.%s is set by the chart (containerPort, workers, metricsToken); remove it from config" $k) -}}{{- end -}}
{{- end -}}
{{- if and (not .Values.upstreams) (not .Values.backend.enabled) -}}
{{- fail "no upstreams: list your engines under upstreams, or set backend.enabled" -}}
{{- end -}}
{{- $own := list (printf "%s-tenants" (include "kvgate.fullname" .)) (include "kvgate.secretName" .) -}}
{{- if has .Values.tenants.existingSecret $own -}}
{{- fail (printf "tenants.existingSecret %q is a Secret this chart renders and Helm owns (%s: tenants.list and the first tenant; %s: the generated keys): creating it with kubectl fails (AlreadyExists), and naming %s here stops the chart rendering it, so the upgrade deletes the Secret the pods mount. Put your tenants file in a Secret of another name, e.g. kvgate-my-tenants" .Values.tenants.existingSecret (index $own 0) (index $own 1) (index $own 0)) -}}
{{- end -}}
{{- $quotasOn := ternary ($cfg.quotas | default dict).enabled true (hasKey ($cfg.quotas | default dict) "enabled") -}}
{{- $verifierOn := ternary ($cfg.verifier | default dict).enabled true (hasKey ($cfg.verifier | default dict) "enabled") -}}
{{- if and (eq .Values.redis.mode "none") (or $quotasOn $verifierOn) -}}
{{- if gt (include "kvgate.workers" . | int) 1 -}}
{{- fail (printf "%d workers per pod need Redis (redis.mode): quotas and the leak index would be kept apart in each worker. Set redis, or workers: 1" (include "kvgate.workers" . | int)) -}}
{{- end -}}
{{- if gt (include "kvgate.maxPods" . | int) 1 -}}
{{- fail "more than one gateway pod needs Redis (redis.mode): each pod would admit every tenant's full quota. Set redis, or replicaCount: 1 without autoscaling" -}}
{{- end -}}
{{- end -}}
{{- if ne .Values.redis.mode "none" -}}
{{- if and (eq .Values.redis.mode "cluster") (ne (int .Values.redis.db) 0) -}}
{{- fail (printf "redis.db (%d): Redis Cluster has only database 0, which the gateway would then use (shared with whatever else uses the cluster); set redis.db: 0" (int .Values.redis.db)) -}}
{{- end -}}
{{- if not .Values.redis.hosts -}}{{- fail (printf "redis.mode %s needs redis.hosts (HOST:PORT entries)" .Values.redis.mode) -}}{{- end -}}
{{- if and (eq .Values.redis.mode "standalone") (gt (len .Values.redis.hosts) 1) -}}
{{- fail "redis.mode standalone takes one entry in redis.hosts (use sentinel or cluster for several)" -}}
{{- end -}}
{{- end -}}
{{- $q := $cfg.quotas | default dict -}}
{{- if and (hasKey $q "replicas") (lt (int $q.replicas) (include "kvgate.maxPods" . | int)) -}}
{{- fail (printf "config.quotas.replicas (%d) is below the most gateway pods there can be (%d): under redis_failure_policy local_fallback the pods together would admit more than each limit. Leave it out (the chart sets it) or raise it" (int $q.replicas) (include "kvgate.maxPods" . | int)) -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling.minReplicas (%d) is above autoscaling.maxReplicas (%d)" (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if and .Values.pdb.enabled (not (kindIs "invalid" .Values.pdb.minAvailable)) -}}
{{- if ge (int .Values.pdb.minAvailable) (include "kvgate.minPods" . | int) -}}
{{- fail (printf "pdb.minAvailable (%d) is not below the replica count (%d): no node drain could ever evict a gateway pod; lower it or use pdb.maxUnavailable" (int .Values.pdb.minAvailable) (include "kvgate.minPods" . | int)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
