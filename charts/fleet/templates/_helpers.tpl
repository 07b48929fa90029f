{{/*
Names, labels, the profile read from fleet.toml, env and the checks that make rendering fail.
*/}}

{{- define "fleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's prefix, short enough that the longest suffix ("-migrate-config", 15) keeps
every resource name within 63 characters. */}}
{{- define "fleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's resource name: (dict "root" $ "suffix" "gateway"). */}}
{{- define "fleet.componentName" -}}
{{- printf "%s-%s" (include "fleet.fullname" .root) .suffix | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of every resource: (dict "root" $ "component" "gateway"). */}}
{{- define "fleet.labels" -}}
helm.sh/chart: {{ include "fleet.chart" .root }}
{{ include "fleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: fleet
{{- end }}

{{- define "fleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "fleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "fleet.image" -}}
{{- $image := index .root.Values.image .target }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/* The fleet.toml every container reads: values' override, else the shipped copy. */}}
{{- define "fleet.fleetToml" -}}
{{- if .Values.config.fleetToml }}
{{- .Values.config.fleetToml }}
{{- else }}
{{- .Files.Get "files/fleet.toml" }}
{{- end }}
{{- end }}

{{/*
What the chart needs from the selected profile, as YAML (read it with fromYaml). Defaults are
the config schema's (shared/src/fleet_shared/config_file.py) for keys a profile leaves out.
*/}}
{{- define "fleet.settings" -}}
{{- $file := include "fleet.fleetToml" . | fromToml }}
{{- if $file.Error }}
{{- fail (printf "config.fleetToml is not valid TOML: %s" $file.Error) }}
{{- end }}
{{- $name := .Values.config.profile }}
{{- $profiles := $file.profiles | default dict }}
{{- if not (hasKey $profiles $name) }}
{{- fail (printf "config.profile %q is not a profile of fleet.toml (known: %s)" $name (keys $profiles | sortAlpha | join ", ")) }}
{{- end }}
{{- $p := index $profiles $name }}
{{- $worker := $p.worker | default dict }}
{{- $gateway := $p.gateway | default dict }}
{{- $auth := $gateway.auth | default dict }}
{{- $runtime := $p.runtime | default dict }}
{{- $sandbox := $p.sandbox | default dict }}
{{- $local := $sandbox.local | default dict }}
{{- $storage := $p.storage | default dict }}
{{- $blobs := $storage.blobs | default dict }}
{{- $needs := list }}
{{- $llm := $p.llm | default dict }}
{{- range $role := list "root" "sub" }}
{{- $lm := index $llm $role | default dict }}
{{- range $field := list "model_env" "api_key_env" "base_url_env" }}
{{- if index $lm $field }}
{{- $needs = append $needs (dict "env" (index $lm $field) "key" (printf "llm.%s.%s" $role $field)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $provider := $sandbox.provider | default "local" }}
{{- if eq $provider "daytona" }}
{{- $daytona := $sandbox.daytona | default dict }}
{{- $needs = append $needs (dict "env" ($daytona.api_key_env | default "FLEET_DAYTONA_API_KEY") "key" "sandbox.daytona.api_key_env") }}
{{- if $daytona.api_url_env }}
{{- $needs = append $needs (dict "env" $daytona.api_url_env "key" "sandbox.daytona.api_url_env") }}
{{- end }}
{{- end }}
{{- /* blobStore.url and dev.minio replace the profile's storage.blobs, and its env vars with it. */}}
{{- if not (or .Values.blobStore.url .Values.dev.minio.enabled) }}
{{- range $field := list "s3_endpoint_env" "s3_access_key_env" "s3_secret_key_env" }}
{{- if index $blobs $field }}
{{- $needs = append $needs (dict "env" (index $blobs $field) "key" (printf "storage.blobs.%s" $field)) }}
{{- end }}
{{- end }}
{{- end }}
name: {{ $name | quote }}
queueName: {{ $worker.queue_name | default "fleet:queue" | quote }}
drainSeconds: {{ $worker.drain_seconds | default 30 | ceil | int }}
concurrency: {{ $worker.concurrency | default 4 | int }}
shutdownGraceSeconds: {{ $gateway.shutdown_grace_seconds | default 5 | ceil | int }}
streamMaxSeconds: {{ $gateway.stream_max_seconds | default 900 | ceil | int }}
heartbeatSeconds: {{ $runtime.heartbeat_seconds | default 10 }}
tokenEnv: {{ $auth.token_env | default "FLEET_API_TOKEN" | quote }}
{{- $jwt := $auth.jwt | default dict }}
authMode: {{ .Values.gateway.auth.mode | default $auth.mode | default "token" | quote }}
jwksUrl: {{ .Values.gateway.auth.jwt.jwksUrl | default $jwt.jwks_url | default "" | quote }}
jwtIssuer: {{ .Values.gateway.auth.jwt.issuer | default $jwt.issuer | default "" | quote }}
jwtAudience: {{ .Values.gateway.auth.jwt.audience | default $jwt.audience | default "" | quote }}
provider: {{ $provider | quote }}
memoryMb: {{ $local.memory_mb | default 1024 | int }}
blobBackend: {{ $blobs.backend | default "local" | quote }}
needs: {{ $needs | toJson }}
{{- end }}

{{/* A secretKeyRef for (dict "root" $ "ref" .Values.secrets.x); the ref must have a key. */}}
{{- define "fleet.secretKeyRef" -}}
secretKeyRef:
  name: {{ default .root.Values.secrets.existingSecret .ref.name | quote }}
  key: {{ .ref.key | quote }}
{{- end }}

{{/* True ("true") when a secret reference is complete: a key, and a Secret name to find it in. */}}
{{- define "fleet.hasSecret" -}}
{{- if and .ref.key (or .ref.name .root.Values.secrets.existingSecret) }}true{{ end }}
{{- end }}

{{/* The env vars each source provides, by variable name (what the profile's needs are checked
against). FLEET_DATABASE_URL and FLEET_REDIS_URL are checked on their own. */}}
{{- define "fleet.providedEnv" -}}
{{- $s := include "fleet.settings" . | fromYaml }}
{{- $provided := dict }}
{{- if .Values.lm.model }}{{ $_ := set $provided "FLEET_LM_MODEL" "lm.model" }}{{ end }}
{{- if .Values.lm.baseUrl }}{{ $_ := set $provided "FLEET_LM_BASE_URL" "lm.baseUrl" }}{{ end }}
{{- if .Values.daytona.apiUrl }}{{ $_ := set $provided "FLEET_DAYTONA_API_URL" "daytona.apiUrl" }}{{ end }}
{{- if include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.lmApiKey) }}{{ $_ := set $provided "FLEET_LM_API_KEY" "secrets.lmApiKey" }}{{ end }}
{{- if include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.daytonaApiKey) }}{{ $_ := set $provided "FLEET_DAYTONA_API_KEY" "secrets.daytonaApiKey" }}{{ end }}
{{- if include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.apiToken) }}{{ $_ := set $provided $s.tokenEnv "secrets.apiToken" }}{{ end }}
{{- range .Values.extraEnv }}{{ $_ := set $provided .name "extraEnv" }}{{ end }}
{{- toJson $provided }}
{{- end }}

{{/* Where each well-known variable comes from, for the failure message. */}}
{{- define "fleet.envHint" -}}
{{- $hints := dict
  "FLEET_LM_MODEL" "set lm.model"
  "FLEET_LM_BASE_URL" "set lm.baseUrl"
  "FLEET_LM_API_KEY" "set secrets.lmApiKey.key (in secrets.existingSecret or secrets.lmApiKey.name)"
  "FLEET_DAYTONA_API_KEY" "set secrets.daytonaApiKey.key (in secrets.existingSecret or secrets.daytonaApiKey.name)"
  "FLEET_DAYTONA_API_URL" "set daytona.apiUrl" }}
{{- get $hints . | default "add it to extraEnv" }}
{{- end }}

{{/*
Every rule values.schema.json cannot express. Included by each workload template, so that any
`helm template`/`install` fails with one clear line.
*/}}
{{- define "fleet.validate" -}}
{{- $s := include "fleet.settings" . | fromYaml }}
{{- $provided := include "fleet.providedEnv" . | fromJson }}
{{- range $s.needs }}
{{- if not (hasKey $provided .env) }}
{{- fail (printf "profile %q reads %s (%s): %s" $s.name .env .key (include "fleet.envHint" .env)) }}
{{- end }}
{{- end }}
{{- if not .Values.dev.postgresql.enabled }}
{{- if not (include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.databaseUrl)) }}
{{- fail "FLEET_DATABASE_URL: set secrets.existingSecret (or secrets.databaseUrl.name) and secrets.databaseUrl.key, or dev.postgresql.enabled=true for a dev cluster" }}
{{- end }}
{{- end }}
{{- if not .Values.dev.redis.enabled }}
{{- if not (include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.redisUrl)) }}
{{- fail "FLEET_REDIS_URL: set secrets.existingSecret (or secrets.redisUrl.name) and secrets.redisUrl.key, or dev.redis.enabled=true for a dev cluster" }}
{{- end }}
{{- end }}
{{- if eq $s.authMode "tokens" }}
{{- if not (include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.tokensFile)) }}
{{- fail "gateway.auth.mode=tokens reads a tokens file: set secrets.tokensFile.key (in secrets.existingSecret or secrets.tokensFile.name)" }}
{{- end }}
{{- else if eq $s.authMode "jwt" }}
{{- if not (and $s.jwksUrl $s.jwtIssuer $s.jwtAudience) }}
{{- fail "gateway.auth.mode=jwt needs the provider: set gateway.auth.jwt.jwksUrl, issuer and audience (or the profile's gateway.auth.jwt)" }}
{{- end }}
{{- else if not (or .Values.gateway.allowUnauthenticated (include "fleet.hasSecret" (dict "root" . "ref" .Values.secrets.apiToken))) }}
{{- fail (printf "the gateway refuses to serve off loopback without %s: set secrets.apiToken.key (in secrets.existingSecret or secrets.apiToken.name), gateway.auth.mode=tokens or jwt, or gateway.allowUnauthenticated=true when a proxy in front authenticates" $s.tokenEnv) }}
{{- end }}
{{- if and (eq .Values.worker.sandbox.mode "daytona") (ne $s.provider "daytona") }}
{{- fail (printf "worker.sandbox.mode=daytona but profile %q has sandbox.provider = %q: choose a daytona profile (config.profile) or a local mode (userns, privileged)" $s.name $s.provider) }}
{{- end }}
{{- if and (ne .Values.worker.sandbox.mode "daytona") (eq $s.provider "daytona") }}
{{- fail (printf "profile %q runs cells in Daytona: set worker.sandbox.mode=daytona" $s.name) }}
{{- end }}
{{- $workerGrace := .Values.worker.terminationGracePeriodSeconds }}
{{- if and (not (kindIs "invalid" $workerGrace)) (lt (int $workerGrace) (add $s.drainSeconds (include "fleet.workerSettleSeconds" .) | int)) }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%d) must be at least the profile's worker.drain_seconds (%d) + %s s (settling, closing pools, up to 30 s killing sandboxes), or the kubelet kills the worker before its sandboxes are released" (int $workerGrace) (int $s.drainSeconds) (include "fleet.workerSettleSeconds" .)) }}
{{- end }}
{{- $gatewayGrace := .Values.gateway.terminationGracePeriodSeconds }}
{{- if and (not (kindIs "invalid" $gatewayGrace)) (le (int $gatewayGrace) (add .Values.gateway.preStopSleepSeconds $s.shutdownGraceSeconds | int)) }}
{{- fail (printf "gateway.terminationGracePeriodSeconds (%d) must exceed gateway.preStopSleepSeconds (%d) + the profile's gateway.shutdown_grace_seconds (%d)" (int $gatewayGrace) (int .Values.gateway.preStopSleepSeconds) (int $s.shutdownGraceSeconds)) }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.serverAddress) }}
{{- fail "keda.enabled=true needs keda.serverAddress, the Prometheus that scrapes fleet_queue_depth" }}
{{- end }}
{{- if and .Values.keda.enabled .Values.worker.autoscaling.enabled }}
{{- fail "keda.enabled and worker.autoscaling.enabled both scale the workers: choose one" }}
{{- end }}
{{- if and .Values.keda.enabled (eq (int .Values.keda.minReplicas) 0) (eq .Values.gateway.readinessPath "/ready") }}
{{- fail "keda.minReplicas=0 with gateway.readinessPath=/ready: /ready needs a worker heartbeat, so no gateway would be ready to queue the Turn that wakes a worker; use /health or minReplicas >= 1" }}
{{- end }}
{{- $workersFixed := not (or .Values.keda.enabled .Values.worker.autoscaling.enabled) }}
{{- if and $workersFixed (eq (int .Values.worker.replicas) 0) (eq .Values.gateway.readinessPath "/ready") }}
{{- fail "worker.replicas=0 with gateway.readinessPath=/ready: /ready needs a worker heartbeat, so no gateway would ever be ready; use /health or replicas >= 1" }}
{{- end }}
{{- include "fleet.validateBlobStore" . }}
{{- range $scaler := list
  (dict "name" "gateway.autoscaling" "on" .Values.gateway.autoscaling.enabled "min" .Values.gateway.autoscaling.minReplicas "max" .Values.gateway.autoscaling.maxReplicas)
  (dict "name" "worker.autoscaling" "on" .Values.worker.autoscaling.enabled "min" .Values.worker.autoscaling.minReplicas "max" .Values.worker.autoscaling.maxReplicas)
  (dict "name" "keda" "on" .Values.keda.enabled "min" .Values.keda.minReplicas "max" .Values.keda.maxReplicas) }}
{{- if and $scaler.on (gt (int $scaler.min) (int $scaler.max)) }}
{{- fail (printf "%s.minReplicas (%d) is above %s.maxReplicas (%d)" $scaler.name (int $scaler.min) $scaler.name (int $scaler.max)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Seconds a worker needs after its drain: settling the Turns it cancelled, closing its pools
and killing its sandboxes (SANDBOX_CLOSE_SECONDS, 30, in fleet_worker/app.py), with a margin. */}}
{{- define "fleet.workerSettleSeconds" -}}
45
{{- end }}

{{/* Turns one worker runs at once: worker.concurrency, else the profile's. */}}
{{- define "fleet.workerConcurrency" -}}
{{- $s := include "fleet.settings" . | fromYaml }}
{{- if kindIs "invalid" .Values.worker.concurrency }}
{{- $s.concurrency }}
{{- else }}
{{- .Values.worker.concurrency }}
{{- end }}
{{- end }}

{{- define "fleet.workerGraceSeconds" -}}
{{- $s := include "fleet.settings" . | fromYaml }}
{{- if kindIs "invalid" .Values.worker.terminationGracePeriodSeconds }}
{{- add $s.drainSeconds (include "fleet.workerSettleSeconds" .) }}
{{- else }}
{{- .Values.worker.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{- define "fleet.gatewayGraceSeconds" -}}
{{- $s := include "fleet.settings" . | fromYaml }}
{{- if kindIs "invalid" .Values.gateway.terminationGracePeriodSeconds }}
{{- add .Values.gateway.preStopSleepSeconds $s.shutdownGraceSeconds 10 }}
{{- else }}
{{- .Values.gateway.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Redis and database URLs: (dict "root" $ "redis" bool). A secretKeyRef each, or the dev
services' plain URLs (they have no password). */}}
{{- define "fleet.storageEnv" -}}
{{- $root := .root }}
{{- if $root.Values.dev.postgresql.enabled }}
- name: FLEET_DATABASE_URL
  value: {{ printf "postgresql+asyncpg://fleet@%s:5432/fleet" (include "fleet.componentName" (dict "root" $root "suffix" "postgresql")) | quote }}
{{- else }}
- name: FLEET_DATABASE_URL
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" $root "ref" $root.Values.secrets.databaseUrl) | nindent 4 }}
{{- end }}
{{- if .redis }}
{{- if $root.Values.dev.redis.enabled }}
- name: FLEET_REDIS_URL
  value: {{ printf "redis://%s:6379/0" (include "fleet.componentName" (dict "root" $root "suffix" "redis")) | quote }}
{{- else }}
- name: FLEET_REDIS_URL
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" $root "ref" $root.Values.secrets.redisUrl) | nindent 4 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A container's env: (dict "root" $ "component" "gateway"|"worker"|"migrate"|"doctor"). Each
component gets only the credentials it uses: the LM and Daytona keys go to workers (and the
doctor), the API token to gateways, the object store to all but the migration, which gets the
database alone.
*/}}
{{- define "fleet.env" -}}
{{- $root := .root }}
{{- $s := include "fleet.settings" $root | fromYaml }}
{{- $withLM := has .component (list "worker" "doctor") -}}
- name: FLEET_CONFIG
  value: /etc/fleet/fleet.toml
- name: FLEET_PROFILE
  value: {{ $s.name | quote }}
{{- include "fleet.storageEnv" (dict "root" $root "redis" (ne .component "migrate")) }}
{{- if ne .component "migrate" }}
{{- include "fleet.blobEnv" $root }}
{{- end }}
{{- with $root.Values.lm.model }}
- name: FLEET_LM_MODEL
  value: {{ . | quote }}
{{- end }}
{{- if $withLM }}
{{- with $root.Values.lm.baseUrl }}
- name: FLEET_LM_BASE_URL
  value: {{ . | quote }}
{{- end }}
{{- if include "fleet.hasSecret" (dict "root" $root "ref" $root.Values.secrets.lmApiKey) }}
- name: FLEET_LM_API_KEY
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" $root "ref" $root.Values.secrets.lmApiKey) | nindent 4 }}
{{- end }}
{{- with $root.Values.daytona.apiUrl }}
- name: FLEET_DAYTONA_API_URL
  value: {{ . | quote }}
{{- end }}
{{- if include "fleet.hasSecret" (dict "root" $root "ref" $root.Values.secrets.daytonaApiKey) }}
- name: FLEET_DAYTONA_API_KEY
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" $root "ref" $root.Values.secrets.daytonaApiKey) | nindent 4 }}
{{- end }}
{{- end }}
{{- if and (has .component (list "gateway" "worker")) (include "fleet.hasSecret" (dict "root" $root "ref" $root.Values.secrets.webhookSecret)) }}
- name: FLEET_WEBHOOK_SECRET
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" $root "ref" $root.Values.secrets.webhookSecret) | nindent 4 }}
{{- end }}
{{- if and (eq .component "gateway") (include "fleet.hasSecret" (dict "root" $root "ref" $root.Values.secrets.apiToken)) }}
- name: {{ $s.tokenEnv }}
  valueFrom:
    {{- include "fleet.secretKeyRef" (dict "root" $root "ref" $root.Values.secrets.apiToken) | nindent 4 }}
{{- end }}
{{- if eq .component "gateway" }}
{{- $auth := $root.Values.gateway.auth }}
{{- range $name, $value := dict "FLEET_AUTH_MODE" $auth.mode "FLEET_AUTH_JWKS_URL" $auth.jwt.jwksUrl "FLEET_AUTH_JWT_ISSUER" $auth.jwt.issuer "FLEET_AUTH_JWT_AUDIENCE" $auth.jwt.audience "FLEET_AUTH_JWT_TENANT_CLAIM" $auth.jwt.tenantClaim }}
{{- if $value }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- if include "fleet.hasSecret" (dict "root" $root "ref" $root.Values.secrets.tokensFile) }}
- name: FLEET_AUTH_TOKENS_FILE
  value: /etc/fleet/auth/tokens.toml
{{- end }}
{{- end }}
- name: HOME
  value: /tmp
{{- with $root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The restricted container securityContext (gateway, migration, daytona-mode workers). */}}
{{- define "fleet.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* fsGroupChangePolicy: a large shared data volume is not chowned on every pod start. */}}
{{- define "fleet.podSecurityContext" -}}
runAsNonRoot: true
{{ toYaml .Values.podSecurityContext }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The config volume (the ConfigMap named .configMap) and the writable /tmp. */}}
{{- define "fleet.configVolumes" -}}
- name: config
  configMap:
    name: {{ .configMap }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- end }}

{{/* fleet.toml is mounted as one file over the image's copy, so the image's scripts/ and
skills/ beside it stay visible. */}}
{{- define "fleet.configMounts" -}}
- name: config
  mountPath: /etc/fleet/fleet.toml
  subPath: fleet.toml
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "fleet.dataVolume" -}}
- name: data
{{- if .Values.dataVolume.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.dataVolume.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.dataVolume.emptyDirSizeLimit }}
{{- end }}
{{- end }}

{{- define "fleet.configChecksum" -}}
{{- include "fleet.fleetToml" . | sha256sum }}
{{- end }}

{{/*
The worker's pod-level security fields for worker.sandbox.mode (docs/deployment.md):
- userns: bwrap builds its jail in an unprivileged user namespace. The pod gets a user
  namespace of its own (hostUsers: false), so /proc can be left unmasked for bwrap to mount a
  fresh one, and the container's seccomp/AppArmor profiles must allow unshare and mount.
- privileged: root in a privileged container, so /sys/fs/cgroup is writable for per-sandbox
  memory, pids and CPU limits. Cells still run as non-root uids of their own.
- daytona: no local sandbox: the same restricted pod as the gateway.
*/}}
{{- define "fleet.workerPodSecurity" -}}
{{- $mode := .Values.worker.sandbox.mode -}}
{{- if eq $mode "userns" }}
hostUsers: false
securityContext:
  {{- include "fleet.podSecurityContext" . | nindent 2 }}
{{- else if eq $mode "privileged" }}
securityContext:
  runAsNonRoot: false
  runAsUser: 0
  runAsGroup: 0
  fsGroup: {{ .Values.podSecurityContext.fsGroup }}
  fsGroupChangePolicy: OnRootMismatch
{{- else }}
securityContext:
  {{- include "fleet.podSecurityContext" . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "fleet.workerContainerSecurity" -}}
{{- $mode := .Values.worker.sandbox.mode -}}
{{- if eq $mode "userns" }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
runAsNonRoot: true
capabilities:
  drop: [ALL]
procMount: Unmasked
seccompProfile:
  {{- toYaml .Values.worker.sandbox.seccompProfile | nindent 2 }}
appArmorProfile:
  {{- toYaml .Values.worker.sandbox.appArmorProfile | nindent 2 }}
{{- else if eq $mode "privileged" }}
privileged: true
allowPrivilegeEscalation: true
readOnlyRootFilesystem: true
runAsNonRoot: false
runAsUser: 0
{{- else }}
{{- include "fleet.restrictedContainerSecurityContext" . }}
{{- end }}
{{- end }}

{{/* The worker's volumes (the doctor test pod shares them). */}}
{{- define "fleet.workerVolumes" -}}
{{- include "fleet.configVolumes" (dict "configMap" (include "fleet.componentName" (dict "root" . "suffix" "config"))) }}
{{ include "fleet.dataVolume" . }}
{{- if eq .Values.worker.sandbox.mode "privileged" }}
# A root worker keeps workspaces here when a sandbox uid cannot pass through the data dir's
# parents (docs/deployment.md, sandbox host requirements).
- name: relocated-workspaces
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "fleet.workerMounts" -}}
{{- include "fleet.configMounts" . }}
- name: data
  mountPath: {{ .Values.dataVolume.mountPath }}
{{- if eq .Values.worker.sandbox.mode "privileged" }}
- name: relocated-workspaces
  mountPath: /var/lib/fleet
{{- end }}
{{- end }}

{{/*
checkov skips that hold only for one worker sandbox mode, as annotations on the resource, each
with its reason (the chart-wide ones are in ci/checkov.yaml).
*/}}
{{- define "fleet.workerCheckovSkips" -}}
{{- $mode := .Values.worker.sandbox.mode -}}
{{- if eq $mode "userns" }}
checkov.io/skip1: "CKV_K8S_31=bwrap needs unshare and mount, which RuntimeDefault refuses without CAP_SYS_ADMIN; worker.sandbox.seccompProfile can name a Localhost profile instead"
{{- else if eq $mode "privileged" }}
checkov.io/skip1: "CKV_K8S_16=privileged mode exists for writable cgroups (per-sandbox memory, pids, CPU limits); userns mode is the unprivileged choice"
checkov.io/skip2: "CKV_K8S_20=implied by privileged: true (cgroup mode)"
checkov.io/skip3: "CKV_K8S_23=the cgroup mode's worker is root to create cgroups and give each workspace its own uid; cells never run as root"
checkov.io/skip4: "CKV_K8S_28=a privileged container has every capability; cells get none (bwrap, seccomp)"
checkov.io/skip5: "CKV_K8S_37=a privileged container has every capability; cells get none (bwrap, seccomp)"
checkov.io/skip6: "CKV_K8S_40=root (uid 0) by design in cgroup mode"
checkov.io/skip7: "CKV_K8S_31=privileged containers run unconfined; the jail applies its own seccomp filter to every cell"
{{- end }}
{{- end }}

{{/* The gateway's Service names, short to fully qualified, then gateway.allowedHosts. */}}
{{- define "fleet.gatewayHosts" -}}
{{- $svc := include "fleet.componentName" (dict "root" . "suffix" "gateway") -}}
{{- $ns := .Release.Namespace -}}
{{- $names := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- join "," (concat $names .Values.gateway.allowedHosts) -}}
{{- end }}
